"""Small real models and failure-injecting wrappers shared by the tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ppo_lifecycle.memory import HostMemoryBackend, MemoryBackend
from ppo_lifecycle.process_groups import ReloadableProcessGroups
from ppo_lifecycle.stats import TransferStats


def tiny_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[torch.Tensor | None]:
    for p in model.parameters():
        yield p
        yield p.grad
    for st in opt.state.values():
        yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def track_all(backend: MemoryBackend, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    backend.track("weights", lambda: model.parameters())
    backend.track("grads", lambda: (p.grad for p in model.parameters()))
    backend.track(
        "optimizer",
        lambda: (v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)),
    )


class Snapshot(list):  # type: ignore[type-arg]
    """Byte copies of tensors; ``==`` compares them bit for bit."""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, list)
            and len(self) == len(other)
            and all(torch.equal(a, b) for a, b in zip(self, other, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    return Snapshot(
        t.detach().clone().reshape(-1).view(torch.uint8) for t in state_tensors(model, opt) if t is not None
    )


class FlakyBackend:
    """A real HostMemoryBackend whose release/restore raise on chosen calls, before doing anything."""

    def __init__(self, inner: HostMemoryBackend | None = None) -> None:
        self.inner = inner or HostMemoryBackend()
        self.fail_release = 0  # how many upcoming release() calls raise
        self.fail_restore = 0
        self.released_bytes = 0
        self.restored_bytes = 0

    def region(self, tag: str):  # type: ignore[no-untyped-def]
        return self.inner.region(tag)

    def track(self, tag: str, tensors):  # type: ignore[no-untyped-def]
        self.inner.track(tag, tensors)

    def release(self, tags: Sequence[str] | None = None) -> TransferStats:
        if self.fail_release:
            self.fail_release -= 1
            raise RuntimeError("injected release failure")
        stats = self.inner.release(tags)
        self.released_bytes += stats.bytes
        return stats

    def restore(self, tags: Sequence[str] | None = None) -> TransferStats:
        if self.fail_restore:
            self.fail_restore -= 1
            raise RuntimeError("injected restore failure")
        stats = self.inner.restore(tags)
        self.restored_bytes += stats.bytes
        return stats


class FlakyGroups:
    """Real ReloadableProcessGroups whose destroy/reload raise on chosen calls."""

    def __init__(self, inner: ReloadableProcessGroups) -> None:
        self.inner = inner
        self.fail_destroy = 0
        self.fail_reload = 0
        self.destroys = 0
        self.reloads = 0

    @property
    def is_alive(self) -> bool:
        return self.inner.is_alive

    def destroy(self) -> None:
        if self.fail_destroy:
            self.fail_destroy -= 1
            raise RuntimeError("injected destroy failure")
        if self.inner.is_alive:
            self.destroys += 1
        self.inner.destroy()

    def reload(self) -> None:
        if self.fail_reload:
            self.fail_reload -= 1
            raise RuntimeError("injected reload failure")
        if not self.inner.is_alive:
            self.reloads += 1
        self.inner.reload()
