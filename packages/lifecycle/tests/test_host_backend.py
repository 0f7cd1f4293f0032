from __future__ import annotations

import pytest
import torch
from helpers import snapshot, state_tensors, tiny_model, track_all, train_steps

from ppo_lifecycle.memory import HostCopies, HostMemoryBackend, MemoryBackend, default_backend


def _nbytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for t in state_tensors(model, opt):
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def test_release_frees_storage_and_restore_is_bit_identical_with_same_objects() -> None:
    model, opt = tiny_model()
    train_steps(model, opt, 2, seed=1)  # grads and optimizer state exist
    backend = HostMemoryBackend()
    assert isinstance(backend, MemoryBackend)
    track_all(backend, model, opt)
    before = snapshot(model, opt)
    params = list(model.parameters())
    opt_refs = [p for g in opt.param_groups for p in g["params"]]
    total = _nbytes(model, opt)

    stats = backend.release()
    assert stats.bytes == total
    assert all(t.untyped_storage().nbytes() == 0 for t in state_tensors(model, opt) if t is not None)
    assert all(backend.is_released(t) for t in ("weights", "grads", "optimizer"))

    back = backend.restore()
    assert back.bytes == total
    assert snapshot(model, opt) == before
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert all(a is b for a, b in zip(opt_refs, params, strict=True))


def test_views_and_shared_storage_move_once() -> None:
    base = torch.arange(12, dtype=torch.float32)
    view = base[3:7]
    backend = HostMemoryBackend()
    backend.track("w", lambda: [base, view, base])
    assert backend.release().bytes == 12 * 4
    assert view.untyped_storage().nbytes() == 0
    backend.restore()
    view.add_(100)  # the view still aliases base after restore
    assert base[3].item() == 103.0
    assert base.tolist()[:3] == [0.0, 1.0, 2.0]


def test_release_and_restore_are_idempotent() -> None:
    t = torch.randn(100)
    expected = t.clone()
    backend = HostMemoryBackend()
    backend.track("w", lambda: [t])
    assert backend.restore().bytes == 0  # resident: nothing to restore
    assert backend.release().bytes == 400
    assert backend.release().bytes == 0  # second release: no-op
    assert t.untyped_storage().nbytes() == 0
    assert backend.restore().bytes == 400
    assert backend.restore().bytes == 0
    assert torch.equal(t, expected)


def test_tags_are_released_independently() -> None:
    a, b = torch.ones(10), torch.zeros(20)
    backend = HostMemoryBackend()
    backend.track("a", lambda: [a])
    backend.track("b", lambda: [b])
    assert backend.release(["a"]).bytes == 40
    assert b.untyped_storage().nbytes() == 80
    assert backend.release(["a", "b"]).bytes == 80
    assert backend.restore(["b"]).bytes == 80
    assert a.untyped_storage().nbytes() == 0
    assert backend.restore().bytes == 40
    assert torch.equal(a, torch.ones(10))


def test_tensors_appearing_after_track_are_moved() -> None:
    model, opt = tiny_model()
    backend = HostMemoryBackend()
    track_all(backend, model, opt)  # no grads, no optimizer state yet
    first = backend.release()
    assert first.bytes == sum(p.numel() * 4 for p in model.parameters())
    backend.restore()
    train_steps(model, opt, 1, seed=0)  # grads and exp_avg/exp_avg_sq appear
    before, total = snapshot(model, opt), _nbytes(model, opt)
    second = backend.release()
    assert second.bytes == total
    assert second.bytes > 3 * first.bytes
    backend.restore()
    assert snapshot(model, opt) == before


def test_partial_release_failure_is_retried_without_double_release() -> None:
    tensors = [torch.full((10,), float(i)) for i in range(4)]
    fail = {"armed": True}

    def source():  # type: ignore[no-untyped-def]
        for i, t in enumerate(tensors):
            if i == 2 and fail["armed"]:
                fail["armed"] = False
                raise RuntimeError("source failed midway")
            yield t

    backend = HostMemoryBackend()
    backend.track("w", source)
    # storages are collected before anything moves, so the failure leaves everything resident
    with pytest.raises(RuntimeError, match="midway"):
        backend.release()
    assert all(t.untyped_storage().nbytes() == 40 for t in tensors)
    assert backend.release().bytes == 160
    assert backend.restore().bytes == 160
    assert [t[0].item() for t in tensors] == [0.0, 1.0, 2.0, 3.0]


def test_failure_between_tags_resumes_at_the_failed_tag() -> None:
    a, b = torch.ones(4), torch.ones(8)
    broken = {"on": True}

    def source_b():  # type: ignore[no-untyped-def]
        if broken["on"]:
            raise RuntimeError("tag b failed")
        return [b]

    backend = HostMemoryBackend()
    backend.track("a", lambda: [a])
    backend.track("b", source_b)
    with pytest.raises(RuntimeError, match="tag b failed"):
        backend.release()
    assert backend.is_released("a")
    assert not backend.is_released("b")
    broken["on"] = False
    assert backend.release().bytes == 32  # only b: a is not released twice
    assert backend.restore().bytes == 48


def test_bad_input_is_a_value_error_naming_the_fix() -> None:
    backend = HostMemoryBackend()
    with pytest.raises(ValueError, match="callable"):
        backend.track("w", [torch.ones(1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        backend.track("", lambda: [])
    backend.track("w", lambda: [torch.frombuffer(bytearray(12), dtype=torch.float32)])
    with pytest.raises(ValueError, match="cannot be resized"):
        backend.release()
    with pytest.raises(ValueError, match="unknown memory tag 'nope'"):
        backend.release(["nope"])
    with pytest.raises(ValueError, match="sequence of tag names"):
        backend.release("w")  # type: ignore[arg-type]
    backend.track("x", lambda: [1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="yielded int"):
        backend.release(["x"])


def test_default_backend() -> None:
    assert isinstance(default_backend("cpu"), HostMemoryBackend)
    with pytest.raises(ValueError, match="device type 'meta'"):
        default_backend("meta")


def test_host_copies_serve_released_tensors_without_copying() -> None:
    model, opt = tiny_model()
    train_steps(model, opt, 2, seed=3)
    backend = HostMemoryBackend()
    assert isinstance(backend, HostCopies)
    assert backend.keeps_host_copies
    track_all(backend, model, opt)
    weight = model[0].weight
    tied_view = weight[2:5].t()  # a strided view into the same storage
    expected = [weight.detach().clone(), tied_view.detach().clone()]
    with pytest.raises(ValueError, match="its tag is resident; release its tag first"):
        backend.host_copies([weight])

    backend.release(["weights"])
    copies = backend.host_copies([weight, tied_view])
    assert [c.device.type for c in copies] == ["cpu", "cpu"]
    assert [(c.shape, c.stride(), c.dtype) for c in copies] == [
        (weight.shape, weight.stride(), weight.dtype),
        (tied_view.shape, tied_view.stride(), tied_view.dtype),
    ]
    assert all(torch.equal(c, e) for c, e in zip(copies, expected, strict=True))
    # One storage per tracked storage, exactly its bytes: torch.save and tied-weight detection go by it.
    assert copies[0].untyped_storage().data_ptr() == copies[1].untyped_storage().data_ptr()
    assert copies[0].untyped_storage().nbytes() == weight.numel() * weight.element_size()
    state = next(iter(opt.state.values()))
    with pytest.raises(ValueError, match="no host copy"):
        backend.host_copies([state["exp_avg"]])  # the optimizer tag is resident

    # The copies outlive the wake (the host backend hands each release fresh backups) and stay as
    # they were while training changes the weights.
    backend.restore()
    train_steps(model, opt, 1, seed=4)
    assert not torch.equal(weight.detach(), expected[0])
    assert torch.equal(copies[0], expected[0])


def test_each_storage_is_freed_before_the_next_is_copied() -> None:
    tensors = [torch.full((1000,), float(i)) for i in range(4)]
    seen: list[list[int]] = []

    class Watching(HostMemoryBackend):
        def _copy_out(self, tag, storages):  # type: ignore[no-untyped-def]
            for storage, backup in super()._copy_out(tag, storages):
                seen.append([t.untyped_storage().nbytes() for t in tensors])  # before this one is freed
                yield storage, backup

    backend = Watching()
    backend.track("w", lambda: tensors)
    assert backend.release().bytes == 4 * 4000
    # when storage i's backup is handed over, storages before it are already freed, the rest not yet
    assert seen == [[0] * i + [4000] * (4 - i) for i in range(4)]
    backend.restore()
    assert [t[0].item() for t in tensors] == [0.0, 1.0, 2.0, 3.0]
