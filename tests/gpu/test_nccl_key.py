"""NCCL's side of the routing-table key on a GPU: a one-process NCCL group (the one NCCL group one GPU allows) under
NCCL settings of its own, the key facts a server's rank sends and the key they make; and the doctor's NCCL check
on a machine of one GPU. Each in a fresh process: NCCL reads its variables once, when it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.harness import gpu_count

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"), REPO,
                                                   os.environ.get("PYTHONPATH", "")]))

ONE_RANK = """
import json, socket, torch, torch.distributed as dist
from sglang_sm120.core.facts import key_facts
from sglang_sm120.routing.table import make_key
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
x = torch.ones(8, device="cuda")
dist.all_reduce(x)  # NCCL really started, under these settings
torch.cuda.synchronize()
facts = key_facts(torch.device("cuda", 0))
key = make_key([facts], islands=None, p2p=[[True]], memory="device")
dist.destroy_process_group()
print(json.dumps({"sum": x[0].item(), "facts": facts, "key": key}))
"""


def _key_under(**nccl) -> dict:
    env = {k: v for k, v in ENV.items() if not k.startswith("NCCL_")} | nccl
    done = subprocess.run([sys.executable, "-c", ONE_RANK], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu(1)
@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_a_one_process_nccl_group_keys_its_table_on_the_nccl_settings():
    plain = _key_under()
    tuned = _key_under(NCCL_P2P_LEVEL="SYS", NCCL_DEBUG="WARN")
    assert plain["sum"] == tuned["sum"] == 1.0
    assert tuned["facts"]["nccl"] != "unknown" and tuned["key"]["nccl"] == tuned["facts"]["nccl"]
    # what NCCL moves data by is in the key; where it logs is not
    assert tuned["key"]["nccl_settings"] == {"NCCL_P2P_LEVEL": "SYS"}
    assert plain["key"]["nccl_settings"] == {}
    assert plain["key"] != tuned["key"]
    print(json.dumps({"nccl": tuned["facts"]["nccl"], "nccl_settings": tuned["key"]["nccl_settings"]}))


@pytest.mark.gpu(1)
@pytest.mark.skipif(gpu_count() != 1, reason="the one-GPU message needs exactly one visible GPU")
def test_the_nccl_check_says_in_one_line_that_it_needs_two_gpus():
    done = subprocess.run([sys.executable, "-m", "sglang_sm120.nccl_check"], capture_output=True, text=True,
                          env=ENV, timeout=120)
    print(done.stdout, done.stderr)
    assert "needs two GPUs, this machine has 1" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
