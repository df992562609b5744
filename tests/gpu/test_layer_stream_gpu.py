"""Layer streaming on a GPU: the event handed over with each layer group orders a reader after that group's KV
writes. A reader on another stream that waits for the event and copies the group at once must see the prompt's
final KV, although the engine is still queueing the later layers' kernels (a GPU sleep before each step keeps
the group's own kernels queued too when its hook runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@dataclass
class SideReader:
    engine: Engine
    stream: torch.cuda.Stream
    copies: list[tuple[int, int, tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def layers_written(self, block_ids, num_tokens, layer_begin, layer_end, ready) -> bool:
        assert isinstance(ready, torch.cuda.Event)
        ids = torch.tensor(block_ids, device=self.stream.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            torch.cuda._sleep(1000)
            copy = self.engine.runner.kv_cache[layer_begin:layer_end, :, ids].clone()
        self.copies.append((layer_begin, layer_end, block_ids, copy))
        return True


def test_each_group_is_final_when_its_event_completes(tmp_path) -> None:
    path = write_tiny_hf(tmp_path, "llama", num_hidden_layers=8, hidden_size=256, intermediate_size=1024)
    engine = Engine(
        EngineConfig(
            model=str(path),
            cache=CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8),
            device=DeviceConfig(device="cuda", dtype="bfloat16", enforce_eager=True),
        ),
        prefill_only=True,
        emit_text=False,
    )
    reader = SideReader(engine, torch.cuda.Stream())
    prompt = [(13 * i) % 90 + 5 for i in range(500)]  # the tiny model's context is 512
    engine.add_request("p", prompt, SamplingParams(max_tokens=2))
    engine.stream_layers("p", reader, groups=4)
    first = None
    while engine.has_unfinished():
        torch.cuda._sleep(
            100_000_000
        )  # the GPU lags the host: a group's kernels are still queued at its hook
        first = next((o for o in engine.step() if o.request_id == "p"), first)
    assert first is not None and len(reader.copies) == 4
    torch.cuda.synchronize()
    final = engine.runner.kv_cache[:, :, list(first.kv_block_ids)]
    assert final.abs().sum() > 0  # real data, not an empty cache
    for begin, end, block_ids, copy in reader.copies:
        assert block_ids == first.kv_block_ids
        assert torch.equal(copy, final[begin:end]), (
            f"layers [{begin}, {end}) were read before they were final"
        )
