"""CUDA backend checks on several GB of state: memory really freed and restored, bytes identical.

Plain functions (no pytest needed): ``tests/test_gpu.py`` runs them under pytest, and
``python tests/gpu_checks.py`` runs them directly on a machine without pytest.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from ppo_lifecycle.lifecycle import Lifecycle
from ppo_lifecycle.memory import PinnedHostBackend, TorchMemorySaverBackend, default_backend

GiB = 1 << 30
STATE_GIB = 4
HAVE_TMS = importlib.util.find_spec("torch_memory_saver") is not None


def _make_state(gib: int) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Parameters (bf16 and fp32), their grads and Adam-like fp32 state: ``gib`` GiB in all."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    params, extra = [], []
    per = gib * GiB // 8  # bytes in each of the 8 big tensors (2 params, 2 grads, 4 moments)
    for i in range(2):
        p = nn.Parameter(torch.empty(per // 2, dtype=torch.bfloat16, device="cuda"))
        p.data.uniform_(generator=gen)
        p.grad = torch.rand(per // 2, dtype=torch.bfloat16, device="cuda", generator=gen)
        params.append(p)
        extra += [torch.rand(per // 4, device="cuda", generator=gen) for _ in range(2)]
        if i == 0:
            extra.append(torch.arange(1000, device="cuda"))  # odd-sized tensor
    return params, extra


def _host_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu") for t in tensors]


def _same(tensors: list[torch.Tensor], copies: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(t.detach().view(torch.uint8).cpu(), c.view(torch.uint8))
        for t, c in zip(tensors, copies, strict=True)
    )


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def check_pinned_backend(frees_while_copying: bool = False) -> None:
    """``frees_while_copying``: what the backend must have chosen (True under expandable segments)."""
    torch.cuda.empty_cache()
    params, extra = _make_state(STATE_GIB)
    grads = [p.grad for p in params if p.grad is not None]
    everything = [*params, *grads, *extra]
    copies = _host_copy(everything)
    total = _nbytes(everything)
    backend = default_backend("cuda")
    assert isinstance(backend, PinnedHostBackend)
    assert backend.frees_while_copying is frees_while_copying
    backend.track("weights", lambda: params)
    backend.track("grads", lambda: (p.grad for p in params))
    backend.track("optimizer", lambda: [*extra, torch.zeros(())])  # a CPU scalar (Adam step) is skipped
    assert backend.pinned_bytes >= total
    lc = Lifecycle(backend)
    for cycle in range(3):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        lc.sleep()
        free1 = torch.cuda.mem_get_info()[0]
        assert free1 - free0 >= 0.98 * total, f"cycle {cycle}: freed {(free1 - free0) / GiB:.2f} GiB"
        assert all(t.untyped_storage().nbytes() == 0 for t in everything)
        lc.wake_up()
        free2 = torch.cuda.mem_get_info()[0]
        assert free1 - free2 >= 0.98 * total
        assert _same(everything, copies), f"cycle {cycle}: bytes differ"
        assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    m = lc.pop_metrics()
    assert m["sleep/bytes"] == 3 * total
    assert m["wake/bytes"] == 3 * total
    print(f"pinned: sleep {m['sleep/gb_per_s']:.1f} GB/s, wake {m['wake/gb_per_s']:.1f} GB/s")
    backend.close()


def check_tms_backend(backup: str, tag: str) -> None:
    backend = TorchMemorySaverBackend(backup=backup)  # type: ignore[arg-type]
    torch.cuda.empty_cache()
    with backend.region(tag):
        params, extra = _make_state(STATE_GIB)
    with backend.region(tag + "_kv"):  # a cache: never tracked, its contents are discarded
        kv = torch.ones(GiB // 4, dtype=torch.uint8, device="cuda")
    everything = [*params, *[p.grad for p in params if p.grad is not None], *extra]
    copies = _host_copy(everything)
    total = _nbytes(everything)
    backend.track(tag, lambda: everything)
    for cycle in range(3):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        backend.release()
        backend.release()  # idempotent: must not pause twice (that would abort the process)
        free1 = torch.cuda.mem_get_info()[0]
        assert free1 - free0 >= 0.98 * (total + kv.numel()), f"{backup} cycle {cycle}: freed too little"
        backend.restore()
        backend.restore()
        free2 = torch.cuda.mem_get_info()[0]
        assert free1 - free2 >= 0.98 * total
        assert _same(everything, copies), f"{backup} cycle {cycle}: bytes differ"
        kv.fill_(1)  # the remapped cache is usable
    assert int(kv.sum()) == kv.numel()


if __name__ == "__main__":
    check_pinned_backend()
    if HAVE_TMS:
        for b in ("pinned", "retain"):
            check_tms_backend(b, f"state_{b}")
    else:
        print("torch_memory_saver not installed: its checks skipped")
    print("gpu checks passed")
