"""Manifest schema: the shipped bundle sources validate; bad sources are refused with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from kernelpack.errors import ManifestError
from kernelpack.manifest import BundleSource, canonical_json, is_prerelease, load_source, parse_manifest
from tests.kernelpack.bundle_fixtures import BUNDLES, FAULTS, SHIPPED

BASE = tomllib.loads((BUNDLES / "1.0.0" / "bundle.toml").read_text())


def write(tmp_path: Path, doc: dict) -> Path:
    lines = []

    def emit(prefix: str, d: dict) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict | list) or
                   (isinstance(v, list) and not (v and isinstance(v[0], dict)))}
        for k, v in scalars.items():
            lines.append(f"{k} = {json.dumps(v)}")
        for k, v in d.items():
            if isinstance(v, dict):
                lines.append(f"[{prefix}{k}]")
                emit(f"{prefix}{k}.", v)
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    lines.append(f"[[{prefix}{k}]]")
                    for ik, iv in item.items():
                        if isinstance(iv, dict):
                            inner = ", ".join(
                                f"{a} = {{ {', '.join(f'{x} = {json.dumps(y)}' for x, y in b.items())} }}"
                                for a, b in iv.items())
                            lines.append(f"{ik} = {{ {inner} }}")
                        else:
                            lines.append(f"{ik} = {json.dumps(iv)}")

    emit("", doc)
    (tmp_path / "bundle.toml").write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize("version", SHIPPED)
def test_shipped_sources_validate(version: str) -> None:
    src = load_source(BUNDLES / version)
    assert src.version == version
    assert src.targets.archs == ["sm_80", "sm_89", "sm_90"]
    assert src.targets.triton == "3.6.0"
    assert src.traffic.decode_batch_sizes == [1, 8, 32, 64, 128, 256]
    assert src.traffic.prefill_tokens == [2048, 8192, 16384]


def test_1_1_0_has_arch_specific_configs_and_parent() -> None:
    v10, v11 = load_source(BUNDLES / "1.0.0"), load_source(BUNDLES / "1.1.0")
    assert v11.parent == "1.0.0" and v10.parent is None
    assert [k.op for k in v10.kernels] == [k.op for k in v11.kernels]
    # the sm_90 configs measured faster on the GPU (docs/benchmarks.md); everything else keeps the defaults
    tuned = sorted(k.op for k in v11.kernels if k.config_for("sm_90"))
    assert tuned == ["add_rmsnorm", "bias_gelu_tanh", "flash_attn"]
    assert all(not k.config_for("sm_80") for k in v11.kernels)
    fp8 = next(k for k in v11.kernels if k.op == "fp8_quant")
    assert fp8.built_for(v11.targets) == ["sm_89", "sm_90"]
    assert any(k.config_for("sm_90") != k.config_for("sm_80") for k in v11.kernels)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_fixtures_are_labelled_and_differ_only_in_add_rmsnorm(fault: str) -> None:
    v11 = load_source(BUNDLES / "1.1.0")
    f = load_source(BUNDLES / f"1.2.0-fault.{fault}")
    assert f.fault_fixture and "FAULT FIXTURE" in f.fault_fixture
    assert is_prerelease(f.version) and f.parent == "1.1.0"
    assert f.targets == v11.targets and f.traffic == v11.traffic
    for a, b in zip(v11.kernels, f.kernels, strict=True):
        if a.op == "add_rmsnorm":
            assert b.source == f"kernels/add_rmsnorm_{fault}.py"
            assert (BUNDLES / f"1.2.0-fault.{fault}" / b.source).is_file()
        else:
            assert a == b


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version="1.0"), "not a semantic version"),
        (lambda d: d.update(version="01.0.0"), "not a semantic version"),
        (lambda d: d.update(colour="red"), "colour: Extra inputs are not permitted"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.update(fault_fixture="breaks things"), "prerelease version"),
        (lambda d: d.update(parent="1.0.0"), "must differ from version"),
        (lambda d: d["targets"].update(archs=["sm90"]), "sm_XY"),
        (lambda d: d["targets"].update(torch="2.9 or so"), "not a version specifier"),
        (lambda d: d["targets"].update(cuda=["twelve"]), "CUDA version"),
        (lambda d: d["traffic"].update(decode_batch_sizes=[8, 1]), "strictly increasing"),
        (lambda d: d["kernels"].append(dict(d["kernels"][0])), "same op twice"),
        (lambda d: d["kernels"][0].update(source="../evil.py"), "must be 'kernelpack.kernels.<module>'"),
        (lambda d: d["kernels"][0].update(source="os.system"), "must be 'kernelpack.kernels.<module>'"),
        (lambda d: d["kernels"][0].update(configs={"sm_90": {}}), "'default' entry"),
        (lambda d: d["kernels"][0].update(configs={"default": {}, "sm_75": {"num_warps": 4}}), "not a target"),
        (lambda d: d["kernels"][0].update(configs={"default": {}, "sm_75-t4": {"num_warps": 4}}), "not a target"),
        (lambda d: d["kernels"][0].update(entry="MAIN"), "entry"),
        (lambda d: d["kernels"][0].update(archs=["sm_75"]), "arch sm_75 is not a target arch"),
        (lambda d: d["kernels"][0].update(archs=[]), "non-empty list"),
    ],
)
def test_bad_sources_are_refused_with_a_clear_message(tmp_path: Path, mutate, message: str) -> None:
    doc = json.loads(json.dumps(BASE))
    mutate(doc)
    write(tmp_path, doc)
    with pytest.raises(ManifestError) as ei:
        load_source(tmp_path)
    assert message in str(ei.value)
    assert str(tmp_path / "bundle.toml") in str(ei.value)


def test_prerelease_version_and_round_trip(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(BASE))
    doc.update(version="2.0.0-rc.1+build.5", fault_fixture="demo fault")
    src = load_source(write(tmp_path, doc))
    assert src.version == "2.0.0-rc.1+build.5"
    assert BundleSource.model_validate(src.model_dump()) == src


def test_unreadable_sources(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such file"):
        load_source(tmp_path)
    (tmp_path / "bundle.toml").write_text("name = [unclosed")
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_source(tmp_path)


def test_canonical_json_is_stable() -> None:
    assert canonical_json({"b": 1, "a": [1, 2], "c": {"z": 1.5, "y": None}}) == (
        b'{"a":[1,2],"b":1,"c":{"y":null,"z":1.5}}'
    )


def test_parse_manifest_refuses_garbage_and_non_canonical() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(b"{nope")
    with pytest.raises(ManifestError, match="JSON object"):
        parse_manifest(b"[]")
    with pytest.raises(ManifestError, match="schema_version"):
        parse_manifest(b'{"name":"x"}')


def test_wins_tables_validate_and_stay_out_of_manifests_without_them(tmp_path: Path) -> None:
    """The per-arch wins table (docs/serving.md): sorted, non-overlapping windows for target archs; a kernel
    without one dumps exactly as before the field existed, so manifests signed then still verify."""
    doc = json.loads(json.dumps(BASE))
    k = doc["kernels"][0]
    src = BundleSource.model_validate({**doc, "kernels": [{**k, "wins": {"sm_90": [{"lo": 1, "hi": 64},
                                                                                   {"lo": 2048}]}}]})
    wins = src.kernels[0].wins_for("sm_90")
    assert [(w.lo, w.hi) for w in wins] == [(1, 64), (2048, None)]
    assert src.kernels[0].wins_for("sm_80") is None and src.kernels[0].wins_for(None) is None
    assert [w.contains(t) for t in (1, 64, 65, 2047, 2048, 10**6) for w in wins[1:]] == [False] * 4 + [True] * 2
    for bad, message in (({"sm_75": []}, "not a target arch"), ({"sm_90": [{"lo": 1}, {"lo": 8}]}, "overlap"),
                         ({"sm_90": [{"lo": 8, "hi": 4}]}, "is empty"), ({"sm_90": [{"lo": 0}]}, "greater")):
        with pytest.raises(ValueError, match=message):
            BundleSource.model_validate({**doc, "kernels": [{**k, "wins": bad}]})
    plain = load_source(write(tmp_path, doc)).kernels[0]
    assert plain.wins is None
    assert set(plain.model_dump(mode="json")) == {"op", "source", "entry", "configs", "archs"}  # as before


def test_1_4_0_is_1_3_0_with_flash_attn_on_the_tma_path_for_sm90() -> None:
    """1.3.0 keeps the pointer kernel it was measured with; 1.4.0 changes only flash_attn's sm_90 config."""
    from kernelpack.kernels import flash_attn

    v13, v14 = load_source(BUNDLES / "1.3.0"), load_source(BUNDLES / "1.4.0")
    assert v14.parent == "1.3.0" and [k.op for k in v13.kernels] == [k.op for k in v14.kernels]
    for a, b in zip(v13.kernels, v14.kernels, strict=True):
        for arch in v13.targets.archs:
            if (a.op, arch) != ("flash_attn", "sm_90"):
                assert a.config_for(arch) == b.config_for(arch), (a.op, arch)
    old, new = ({**flash_attn.DEFAULT_CONFIG, **k.config_for("sm_90")} for v in (v13, v14)
                for k in v.kernels if k.op == "flash_attn")
    assert old["TMA"] == 0 and new["TMA"] == 1
    assert new in flash_attn.TUNING_SPACE


def test_a_gpu_models_config_layers_over_its_arch_and_bad_keys_are_refused() -> None:
    """``{arch}-{model}`` entries (one arch spans GPUs whose best configs differ: H100 and H200 are both sm_90):
    default, then the arch, then the model; a model without an entry gets the arch's config."""
    doc = json.loads(json.dumps(BASE))
    k = doc["kernels"][0]
    configs = {"default": {"num_warps": 4}, "sm_90": {"BLOCK_N": 64, "num_stages": 2},
               "sm_90-h200": {"BLOCK_N": 128}, "sm_80-a100": {"num_warps": 8}}
    src = BundleSource.model_validate({**doc, "kernels": [{**k, "configs": configs}]}).kernels[0]
    assert src.config_for("sm_90", "h200") == {"num_warps": 4, "BLOCK_N": 128, "num_stages": 2}
    assert src.config_for("sm_90", "h100") == src.config_for("sm_90") == {"num_warps": 4, "BLOCK_N": 64,
                                                                          "num_stages": 2}
    assert src.config_for("sm_89", "h200") == {"num_warps": 4} == src.config_for(None, "h200")
    assert src.devices_for("sm_90") == ["h200"] and src.devices_for("sm_80") == ["a100"]
    assert src.devices_for("sm_89") == []
    for bad in ("sm_90-H200", "sm_90-", "h200", "sm_90-h200-x", "sm_90.h200"):
        with pytest.raises(ValueError, match="config key"):
            BundleSource.model_validate({**doc, "kernels": [{**k, "configs": {"default": {}, bad: {}}}]})


@pytest.mark.parametrize(("name", "model"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GeForce RTX 4090", "4090"), ("NVIDIA L40S", "l40s"), ("Some GPU", None)])
def test_device_model_names_a_gpu_as_configs_key_it(name: str, model: str | None) -> None:
    from kernelpack.loader import device_model

    assert device_model(name) == model


def test_1_5_0_is_1_4_0_with_a_softmax_config_for_the_h200() -> None:
    """1.5.0 adds one entry, softmax_causal's ``sm_90-h200``: an H200 streams rows wider than WIDE, an H100
    (and any other sm_90 part) keeps 1.4.0's config; the H200's config is one of the swept ones."""
    from kernelpack.kernels import softmax_causal

    v14, v15 = load_source(BUNDLES / "1.4.0"), load_source(BUNDLES / "1.5.0")
    assert v15.parent == "1.4.0" and [k.op for k in v14.kernels] == [k.op for k in v15.kernels]
    for a, b in zip(v14.kernels, v15.kernels, strict=True):
        assert a.wins == b.wins and a.archs == b.archs, a.op
        for arch in v14.targets.archs:
            assert a.config_for(arch) == b.config_for(arch) == b.config_for(arch, "h100"), (a.op, arch)
            assert a.config_for(arch, "h200") == b.config_for(arch, "h200") or (a.op, arch) == (
                "softmax_causal", "sm_90"), (a.op, arch)
    (sm,) = (k for k in v15.kernels if k.op == "softmax_causal")
    h200 = {**softmax_causal.DEFAULT_CONFIG, **sm.config_for("sm_90", "h200")}
    assert h200["WIDE_CHUNK"] == 2048 and h200 in softmax_causal.TUNING_SPACE
