"""Bundle downloads by digest (issue 28), over real HTTP on SQLite and PostgreSQL: the bytes come from the
replica's cache after the first read, a ``Range`` resumes a cut download, the digest is a strong ETag (304),
and a range outside the bundle is 416."""

from __future__ import annotations

import hashlib

import pytest

from controller.bundle_bytes import BundleBytes, byte_range
from tests.controller.serverutil import ControllerProcess, build_test_bundles, register_node


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


def test_download_resumes_with_a_range_and_revalidates_by_digest(db_url: str, tmp_path, bundles) -> None:
    data = bundles.files["1.0.0"].read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with ControllerProcess(db_url, tmp_path, trusted_keys_dir=bundles.keys_dir) as ctl:
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
        node.close()
