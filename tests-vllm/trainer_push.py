"""A trainer process of its own: new weights for a vLLM server over the project's gloo weight group.

``python trainer_push.py URL MODEL OUT VERSION SEED``: loads MODEL (float32), moves every weight by
noise drawn from SEED, sends them all to the server at URL through ``WeightSender`` (gloo, torch 2.15 on
this side, vLLM's torch on the other), sets the version, and saves the weights it sent to OUT (a Hugging
Face folder, the reference the test compares the server against). Prints the update's seconds.
"""

from __future__ import annotations

import sys
import time

import torch
from transformers import AutoModelForCausalLM

from ppo_rollout.engine.handles import model_manifest
from ppo_weight_sync import WeightSender
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint


def main(url: str, model: str, out: str, version: str, seed: int) -> None:
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    endpoint = VLLMEngineEndpoint.for_server(url, model_manifest(model, "float32"), 1, timeout_s=300)
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=300)
    sender.connect([endpoint])
    started = time.perf_counter()
    sender.update(list(actor.state_dict().items()), version)
    print(f"update_seconds={time.perf_counter() - started:.3f}")
    sender.disconnect()
    endpoint.close()
    actor.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
