"""Bundle downloads by digest (issue 28), over real HTTP on SQLite and PostgreSQL: the bytes come from the
replica's cache after the first read, a ``Range`` resumes a cut download, the digest is a strong ETag (304),
and a range outside the bundle is 416; the agent's client resumes a cut download, also in its next call after
it gave up (the partial file is kept)."""

from __future__ import annotations

import hashlib

import pytest

from agents.client import ControllerClient, Unreachable
from controller.bundle_bytes import BundleBytes, byte_range
from kernelctl import wire
from tests.agents.proxy import Proxy
from tests.controller.serverutil import ControllerProcess, Zygote, build_test_bundles, register_node


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory):
    return build_test_bundles(tmp_path_factory.mktemp("download-bundles"), versions=("1.0.0",))


def test_byte_ranges_and_the_cache_by_digest() -> None:
    assert byte_range(None, 10) is None and byte_range("bytes=0-1,4-5", 10) is None
    assert byte_range("bytes=2-", 10) == (2, 9) and byte_range("bytes=-3", 10) == (7, 9)
    assert byte_range("bytes=4-100", 10) == (4, 9)
    for bad in ("bytes=10-", "bytes=5-2", "bytes=x-1", "bytes=-0"):
        with pytest.raises(ValueError):
            byte_range(bad, 10)
    cache = BundleBytes(max_bytes=10)
    loads: list[str] = []
    for digest, data in (("a", b"12345"), ("a", b"?"), ("b", b"123456"), ("a", b"12345")):
        assert cache.get(digest, lambda d=digest, x=data: (loads.append(d), x)[1]) in (b"12345", b"123456")
    assert loads == ["a", "b", "a"]  # kept, then pushed out by b (10 bytes at most), then read again


def test_download_resumes_with_a_range_and_revalidates_by_digest(db_url: str, tmp_path, bundles, zygote: Zygote) -> None:
    data = bundles.files["1.0.0"].read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with ControllerProcess(db_url, tmp_path, trusted_keys_dir=bundles.keys_dir, zygote=zygote) as ctl:
        with ctl.client("operator") as op:
            assert op.post("/v1/bundles", content=data).status_code == 201
        node = register_node(ctl, "gpu-dl")
        url = "/v1/bundles/llm-fused/1.0.0/content"
        whole = node.get(url)
        assert whole.status_code == 200 and whole.content == data
        assert whole.headers["etag"] == f'"{digest}"' and whole.headers["accept-ranges"] == "bytes"
        cut = len(data) // 3
        rest = node.get(url, headers={"Range": f"bytes={cut}-"})
        assert rest.status_code == 206 and data[:cut] + rest.content == data
        assert rest.headers["content-range"] == f"bytes {cut}-{len(data) - 1}/{len(data)}"
        assert node.get(url, headers={"If-None-Match": f'"{digest}"'}).status_code == 304
        assert node.get(url, headers={"Range": f"bytes={len(data)}-"}).status_code == 416
        other = node.get(url, headers={"Range": f"bytes={cut}-", "If-Range": '"0000"'})  # not these bytes
        assert other.status_code == 200 and other.content == data
        token = node.headers["authorization"].split()[1]
        node.close()
        with Proxy(ctl.url) as proxy:  # the agent's download is cut in the middle once: it resumes
            cuts: list[str] = []
            proxy.cut = lambda path: path.endswith("/content") and not cuts and not cuts.append(path)
            client = ControllerClient(proxy.url, token, backoff_initial=0.05, backoff_max=0.2)
            try:
                got = client.download_bundle(wire.BundleRef(name="llm-fused", version="1.0.0", digest=digest),
                                             tmp_path / "dl", max_bytes=1 << 30)
            finally:
                client.close()
        assert got.read_bytes() == data
        assert [s for _m, p, s in proxy.requests] == [200, 206]
        assert proxy.ranges[0] is None and proxy.ranges[1].startswith("bytes=") and proxy.ranges[1] != "bytes=0-"
        with Proxy(ctl.url) as proxy:  # cut every time until the client gives up: the next call resumes
            proxy.cut = lambda path: path.endswith("/content") and len(proxy.requests) <= 2
            client = ControllerClient(proxy.url, token, max_attempts=2, backoff_initial=0.05, backoff_max=0.2)
            ref = wire.BundleRef(name="llm-fused", version="1.0.0", digest=digest)
            try:
                with pytest.raises(Unreachable):
                    client.download_bundle(ref, tmp_path / "dl2", max_bytes=1 << 30)
                kept = tmp_path / "dl2" / f".dl-{digest}.part"
                have = kept.stat().st_size
                assert 0 < have < len(data)  # the partial file is kept for the next attempt
                got = client.download_bundle(ref, tmp_path / "dl2", max_bytes=1 << 30)
            finally:
                client.close()
        assert got.read_bytes() == data
        assert [s for _m, p, s in proxy.requests] == [200, 206, 206]
        assert proxy.ranges[2] == f"bytes={have}-"
