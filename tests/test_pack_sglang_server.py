"""scripts/pack_sglang_server.py's wheel lists per release, on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import pack_sglang_server as pack  # noqa: E402


def test_each_release_carries_what_its_server_path_imports():
    new, old = pack.server_wheels("0.5.23"), pack.server_wheels("0.5.13.post1")
    # 0.5.23 imports xgrammar whatever the grammar backend and builds its JIT kernels with tvm-ffi 0.1.11; it
    # takes the image's transformers and tokenizers
    assert {"xgrammar==0.2.7", "apache-tvm-ffi==0.1.11"} <= set(new)
    assert not any(w.startswith(("transformers==", "tokenizers==")) for w in new)
    # 0.5.13.post1: transformers 5.8.1 (the image's 5.17 refuses its config registration), tvm-ffi 0.1.9
    assert {"transformers==5.8.1", "tokenizers==0.22.2", "apache-tvm-ffi==0.1.9"} <= set(old)
    assert not any(w.startswith("xgrammar") for w in old)
    for wheels in (new, old):
        assert len({w.split("==")[0] for w in wheels}) == len(wheels)  # one version of each
    assert pack.RELEASES == ("0.5.23", "0.5.13.post1")
