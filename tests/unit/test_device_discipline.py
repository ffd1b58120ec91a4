"""Device discipline, checked on a CPU machine with a device that is not the CPU (`meta`).

Contracts checked:
- the package never calls `current_device()` (per thread: a worker thread gets GPU 0) and calls
  torch's object collectives only inside `distributed/devices.py`, whose wrappers move every
  tensor to the CPU first (a pickled CUDA tensor comes back on the sender's device index);
- `devices.to_device` moves every tensor of nested dicts, lists, tuples and namedtuples;
  `host_bytes` pickles them with every tensor on the CPU (CPU tensors' values as they are);
  the wrappers send only such bytes, whatever they are given, and hand back what they
  unpickle;
- `Platform.device()` is the LOCAL_RANK device from any thread; a buffer pool refuses a CUDA
  device without an index instead of guessing the thread's;
- `MegatronRole.logprobs` and `train_step` put every input on the role's device before the
  model sees it (a role on `meta`, its model and schedule stand-ins recording what they get);
- the CPU compatibility layer installs where CUDA is visible but unused, then hides it; it
  refuses a process that has used CUDA (a fresh interpreter, as the layer is process-global).
Faked: torch's object collectives (the wrappers' own test; the distributed tests run them over
real gloo), and the role's model and pipeline schedule (the real ones run in
tests/distributed/test_train_step.py).
"""

from __future__ import annotations

import ast
import collections
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.distributed import devices
from megatron_async_rl.distributed.platform import Platform

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_async_rl"
OBJECT_COLLECTIVES = {
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "send_object_list", "recv_object_list",
}  # fmt: skip
META = torch.device("meta")


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node.func, node.lineno


def test_no_current_device_and_object_collectives_only_through_devices():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for func, line in _calls(path):
            if func.attr == "current_device" and not rel.startswith("compat/"):
                bad.append(f"{rel}:{line}: current_device() (pass Platform.device() instead)")
            target = ast.unparse(func.value)
            if func.attr in OBJECT_COLLECTIVES and target in ("dist", "torch.distributed"):
                if rel != "distributed/devices.py":
                    bad.append(f"{rel}:{line}: {target}.{func.attr} (use devices.{func.attr})")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_a_violation(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import torch.distributed as dist\ndist.all_gather_object(a, b, group=g)\n")
    assert [(f.attr, line) for f, line in _calls(path)] == [("all_gather_object", 2)]


Pair = collections.namedtuple("Pair", "a b")


def test_to_device_and_host_bytes_walk_nested_containers():
    cpu = torch.ones(2)
    obj = {"x": [cpu, (cpu, Pair(cpu, 3))], "n": "text"}
    moved = devices.to_device(obj, META)
    assert moved["x"][0].device == META and moved["x"][1][0].device == META
    assert isinstance(moved["x"][1][1], Pair) and moved["x"][1][1].a.device == META
    assert moved["x"][1][1].b == 3 and moved["n"] == "text"
    back = pickle.loads(devices.host_bytes(moved))
    assert back["x"][0].device.type == "cpu" and back["x"][1][1].a.shape == (2,)
    assert isinstance(back["x"][1][1], Pair) and back["n"] == "text"
    again = pickle.loads(devices.host_bytes(obj))  # already on the host: the same values
    assert torch.equal(again["x"][1][1].a, cpu) and again["x"][1][1].b == 3


def test_object_collective_wrappers_send_only_host_tensors(monkeypatch):
    sent = []

    def all_gather_object(out, obj, group):
        sent.append((obj, group))
        out[:] = [obj] * len(out)

    def gather_object(obj, out, dst, group):
        sent.append((obj, group))
        out[:] = [obj] * len(out)

    def broadcast_object_list(box, src, group):
        sent.extend((item, group) for item in box)

    for fake in (all_gather_object, gather_object, broadcast_object_list):
        monkeypatch.setattr(devices.dist, fake.__name__, fake)
    monkeypatch.setattr(devices.dist, "get_rank", lambda: 0)
    on_device = {"logp": torch.empty(2, 3, device=META)}
    parts = [None, None]
    devices.all_gather_object(parts, on_device, group="g")
    gathered = [None]
    devices.gather_object(on_device, gathered, dst=0, group="g")
    box = [on_device]
    devices.broadcast_object_list(box, src=0, group="g")

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                yield from tensors(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                yield from tensors(item)

    assert len(sent) == 3 and all(isinstance(obj, bytes) for obj, _ in sent)
    assert all(group == "g" for _, group in sent)
    seen = [t for obj, _ in sent for t in tensors(pickle.loads(obj))]
    seen += [t for t in tensors([parts, gathered, box])]  # what the callers get back
    assert len(seen) == 7 and all(t.device.type == "cpu" and t.shape == (2, 3) for t in seen)


def test_platform_device_is_the_local_rank_from_any_thread():
    platform = Platform("cuda", "nccl", local_rank=3)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(platform.device()))
    worker.start()
    worker.join()
    assert seen == [torch.device("cuda", 3)] == [platform.device()]
    assert Platform("cpu", "gloo", local_rank=3).device() == torch.device("cpu")


def test_a_buffer_pool_refuses_a_cuda_device_without_an_index():
    from megatron_async_rl.weight_sync.buffers import BufferPool

    with pytest.raises(ValueError, match="has no index; pass the rank's device"):
        BufferPool().get("produce", 0, 16, device="cuda")


class _Recorder(torch.nn.Module):
    """The model stand-in: records the devices of what it is called with."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.device] = []

    def forward(self, tokens, positions, attention_mask=None):
        self.seen += [tokens.device, positions.device]
        return torch.zeros(*tokens.shape, 8, device=tokens.device)

    def zero_grad_buffer(self):
        pass


def _role_on_meta():
    from megatron_async_rl.roles.megatron_role import MegatronRole

    role = MegatronRole.__new__(MegatronRole)  # no model build: only the entry discipline
    role.role, role.device, role.is_last_stage = "train", META, False
    role.models, role.par = [_Recorder()], SimpleNamespace(pp=1)
    role.pgc, role.spec = SimpleNamespace(tp=None, dp=None), SimpleNamespace(vocab_size=8)
    role.optimizer = SimpleNamespace(zero_grad=lambda: None, step=lambda: (True, 0.0, None))
    batches = []

    def schedule(forward_step, micro_batches, seq_len, mb_size, forward_only):
        batches.extend(micro_batches)
        for mb in micro_batches:
            forward_step(iter([mb]), role.model)
        return []

    role._run_schedule = schedule
    return role, batches


def test_megatron_role_inputs_enter_the_model_on_the_role_device(monkeypatch):
    monkeypatch.setattr(devices.dist, "get_world_size", lambda group=None: 1)
    role, batches = _role_on_meta()
    role.logprobs(torch.ones(4, 5, dtype=torch.long), 2)
    mb = {"tokens": torch.ones(2, 5, dtype=torch.long), "mask": torch.ones(2, 4),
          "adv": torch.ones(2), "old_logp": torch.zeros(2, 4)}  # fmt: skip
    role.train_step([mb, dict(mb)], loss_fn=None)
    (model,) = role.models
    assert model.seen and all(d == META for d in model.seen)
    fields = [
        t for batch in batches for t in (batch.values() if isinstance(batch, dict) else [batch])
    ]
    assert len(fields) == 2 + 2 * 4 and all(t.device == META for t in fields)


def test_the_cpu_layer_installs_beside_a_visible_gpu_and_refuses_a_used_one():
    script = """
import torch
torch.cuda.is_available = lambda: True      # a GPU node: CUDA visible
torch.cuda.is_initialized = lambda: True    # ... and already used by this process
from megatron_async_rl.compat import megatron_cpu
try:
    megatron_cpu.install()
    raise SystemExit("installed in a process that used CUDA")
except RuntimeError as err:
    assert "already uses CUDA" in str(err), err
torch.cuda.is_initialized = lambda: False   # visible, not used: a CPU recipe on a GPU node
megatron_cpu.install()
assert megatron_cpu.installed() and not torch.cuda.is_available()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_ranks_beyond_the_gpus_share_them_over_gloo_and_nccl_refuses(monkeypatch):
    from megatron_async_rl.distributed.platform import detect_platform, local_gpu

    assert [local_gpu(r, 1) for r in range(3)] == [0, 0, 0]
    assert [local_gpu(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert local_gpu(5, 8) == 5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a one-GPU machine: Megatron roles | the engine
    platform = detect_platform("cuda", "gloo")
    assert platform.device() == torch.device("cuda", 0) and platform.local_rank == 1
    with pytest.raises(ValueError, match=r"platform.backend = nccl: local rank 1 .*1 visible"):
        detect_platform("cuda", "nccl")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert detect_platform("cuda", "nccl").device() == torch.device("cuda", 0)
