"""The capacity-window idiom (passes/idioms/lingbot.py) on a plain module written the way LingBot-World's
`_update_cache` is at a repeated chunk start: ``next = cat((cache[:, :C - T], new), 1)``, attention over `next`, and
on a commit ``cache[:, :C].copy_(next)``. No vllm-omni needed: what is accepted, what is refused, and the check that
a graph which keeps its K/V runs only as a committing forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PassError
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.errors import RequestError
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.runtime import PagedKVRuntime

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FRAME, WINDOW_FRAMES, H, D = 4, 3, 2, 8
C = FRAME * WINDOW_FRAMES


class CapacityWindowAttention(torch.nn.Module):
    """LingBot-World's cache arithmetic at a repeated start, on (B, C, H, D) key/value caches; `write_back`
    chooses what a commit copies into the cache (LingBot's: exactly the attended keys/values)."""

    def __init__(self, write_back=lambda attended: attended, into=lambda cache: cache[:, :C]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)
        self.write_back, self.into = write_back, into

    def forward(self, x: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, update: bool) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(2, (3, H, D)).unbind(2)
        chunk = k.shape[1]
        next_k = torch.cat((cache_k[:, : C - chunk], k), dim=1)
        next_v = torch.cat((cache_v[:, : C - chunk], v), dim=1)
        if update:
            self.into(cache_k).copy_(self.write_back(next_k))
            self.into(cache_v).copy_(self.write_back(next_v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), next_k.transpose(1, 2), next_v.transpose(1, 2))
        return out.transpose(1, 2).flatten(2)


def _setup(module):
    rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=FRAME,
                                      blocks_per_layer=WINDOW_FRAMES + 2, max_rows=1, scratch_tokens_per_row=FRAME,
                                      kernel="reference"))
    rt.bind([module])
    rt.admit("s", DreamZeroSpec(frame_seqlen=FRAME, chunk_frames=1, window_frames=WINDOW_FRAMES), rows=1)
    kv = rt.standin(2, 1, C, H, D, writable=True)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    return rt, kv, torch.compile(module, backend=backend, fullgraph=True, dynamic=False), backend


def test_capacity_window_pages_probes_and_commits_and_refuses_a_commit_graph_run_as_a_denoise_step():
    """Probes (no write) and commits (the attended keys copied back) both match 'capacity-window'; the commit
    graph keeps its K/V, so running it as a denoising forward is refused (the runtime would discard what the
    model keeps) and rolled back; the same graph runs as a commit."""
    rt, kv, compiled, backend = _setup(CapacityWindowAttention())
    x = torch.randn(1, FRAME, H * D)
    with torch.no_grad():
        with rt.forward("s", "denoise"):
            compiled(x, kv[0], kv[1], False)
        with rt.forward("s", "commit"):
            compiled(x, kv[0], kv[1], True)
        free = rt.scheduler.allocator.num_free
        with pytest.raises(RequestError, match=r"capacity-window graph keeps its K/V .* but this is a denoise "
                                               r"forward of 's', which discards it"):
            with rt.forward("s", "denoise"):
                compiled(x, kv[0], kv[1], True)
        assert rt.scheduler.allocator.num_free == free
    reports = [r for result in backend.results for r in result.reports]
    assert [r.pattern for r in reports] == ["capacity-window", "capacity-window"], reports
    assert [result.expect.keeps for result in backend.results] == [False, True]


#: the attended keys written back scaled; or written back whole but into the cache's slots in another order (a view
#: that scrambles them), so that the next forward's history slots would not be the tokens the window keeps
WRONG_WRITE_BACKS = {
    "scaled": dict(write_back=lambda attended: attended * 2),
    "scrambled": dict(into=lambda cache: cache.view(1, C * H * D).view(1, H, C, D).transpose(1, 2)),
}


@pytest.mark.parametrize("wrong", sorted(WRONG_WRITE_BACKS))
def test_capacity_window_refuses_a_write_back_of_anything_but_the_attended_keys_in_order(wrong):
    """A commit that copies into the cache something else than what it attended, or the attended keys into other
    slots than the cache's first ones in order, cannot be kept by the paged op: refused in strict mode with the
    reason, never rewritten; no block is held."""
    rt, kv, compiled, _ = _setup(CapacityWindowAttention(**WRONG_WRITE_BACKS[wrong]))
    free = rt.scheduler.allocator.num_free
    with torch.no_grad(), raises_paged(PassError, "it stores something else into the cache than the keys/values it "
                                                  "attends with"):
        with rt.forward("s", "commit"):
            compiled(torch.randn(1, FRAME, H * D), kv[0], kv[1], True)
    assert rt.scheduler.allocator.num_free == free
