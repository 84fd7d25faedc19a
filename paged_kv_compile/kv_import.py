"""K/V another stage computed, written into pages a request reserved before it existed.

An AR stage (the model's language part, another engine) computes a HunyuanImage-3 prompt's K/V; the DiT stage
should not compute it again, nor gather it into a temporary tensor. vllm-omni's design gives the DiT worker
"page-granular destinations" for that transfer and executes none. Here:

  * `reserve(runtime, request_id, spec, ...)` admits the request with its prompt's pages (the same admission a
    request that prefills itself gets: all rows or none, counted by the reservations) and its layout (each row's
    prompt length, the target, read from the prefill mask the dense model would get), and returns an
    `ImportTicket`: per row the destination pages (local block ids, the same in every layer) and a generation;
  * `import_dense` / `import_vllm_blocks` write a producer's K/V into exactly those pages (validated first: a
    refused import writes nothing and marks nothing) and mark them ready, per page;
  * a step forward over pages not all ready, or naming another generation (`import_generation=`), is refused
    before anything is planned; once ready, the steps read the pages as they read a prefill's prompt. The first
    forward of an imported request is a step: it computes only the target span.

Generations: a ticket names the request's admission (its serial) and a generation; `renew` re-makes the
reservation (a new generation, no page ready, the pages taken again after a reset), and a reset, a release, an
abort or the request's own prefill (which computes the prompt itself) ends the import. A ticket of an ended import
or an older generation is refused: a late transfer never lands in pages that now mean something else.

Multi-rank (`distributed.RankRuntime`): every call here is a voted lifecycle call (applied locally, voted, put back
on every rank if any refused); each rank imports its own KV heads (`heads=`, by default the rank's tensor-parallel
slice of a producer's full-head K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from . import families
from .errors import RequestError
from .families.base import Owner
from .imported_pages import ImportRecord

if TYPE_CHECKING:
    from .runtime import PagedKVRuntime

__all__ = ["ImportRecord", "ImportTicket", "reserve", "renew", "ticket", "import_dense", "import_vllm_blocks"]

#: the input layouts `import_dense` reads (see its docstring)
DENSE_LAYOUTS = ("bshd", "bhsd", "rows")


@dataclass(frozen=True)
class ImportTicket:
    """Where a producer writes one request's prompt K/V: per row its pages (local block ids, the same in every
    layer) and how many tokens they hold, of one admission (`serial`) and one reservation (`generation`)."""

    request_id: str
    serial: int
    generation: int
    pages: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]
    block_size: int


# ---- reservation ---------------------------------------------------------------------------------------------


def reserve(runtime: Any, request_id: str, spec: Any, *, prefix_capacity: int | None = None,
            attention_mask: torch.Tensor | None = None, rows: int | None = None) -> ImportTicket:
    """Admit `request_id` of `spec` with its prompt's pages reserved for an import, none ready yet; its layout read
    from `attention_mask` (the prefill mask the dense model would get) or, without one, the reference model's at
    `prefix_capacity`. Refused (nothing admitted) when the layout or the admission is."""

    def apply(local: PagedKVRuntime) -> None:
        family = families.for_spec(spec)
        _check_idle(local)
        _check_layout(local, family, spec, prefix_capacity, attention_mask)  # a refusal admits nothing
        local.admit(request_id, spec, rows)
        _begin(local, local.scheduler.owners[request_id], prefix_capacity, attention_mask)

    _agreed(runtime, "reserve_import", request_id, {"spec": spec, "rows": rows, "prefix_capacity": prefix_capacity,
                                                    "attention_mask": attention_mask}, apply)
    return ticket(runtime, request_id)


def renew(runtime: Any, request_id: str, *, prefix_capacity: int | None = None,
          attention_mask: torch.Tensor | None = None) -> ImportTicket:
    """Re-make the reservation of a live request: a new generation, no page ready (the old ticket is refused from
    now on), its pages taken again if a reset freed them. Also turns a request that prefilled itself into one
    whose next step waits for an import."""

    def apply(local: PagedKVRuntime) -> None:
        _check_idle(local)
        owner = _live(local, request_id)
        _begin(local, owner, prefix_capacity, attention_mask)

    _agreed(runtime, "renew_import", request_id, {"prefix_capacity": prefix_capacity,
                                                  "attention_mask": attention_mask}, apply)
    return ticket(runtime, request_id)


def ticket(runtime: Any, request_id: str) -> ImportTicket:
    """The current ticket of a live request whose import is reserved."""
    owner = _live(_local(runtime), request_id)
    record = _record(owner)
    if record is None:
        raise RequestError(f"request {request_id!r} has no import reserved (never, or it was reset or prefilled "
                           "itself since): kv_import.renew reserves one")
    return ImportTicket(request_id, owner.serial, record.generation, tuple(tuple(r) for r in owner.rows),
                        tuple(owner.family.import_destinations(owner)), _local(runtime).pool.block_size)


def _check_layout(local: PagedKVRuntime, family: Any, spec: Any, prefix_capacity: int | None,
                  attention_mask: torch.Tensor | None) -> None:
    """The family reads and checks the layout on a stand-in owner (no block is taken, nothing is admitted)."""
    probe = Owner("<probe>", family, spec, [[0]])  # holds a block: import_state takes none
    family.import_state(probe, local.scheduler, 0, prefix_capacity=prefix_capacity, attention_mask=attention_mask)


def _begin(local: PagedKVRuntime, owner: Owner, prefix_capacity: int | None,
           attention_mask: torch.Tensor | None) -> None:
    """A new generation of the owner's import: the family's record (layout read, pages taken if needed)."""
    generation = owner.version + 1
    state, taken = owner.family.import_state(owner, local.scheduler, generation, prefix_capacity=prefix_capacity,
                                             attention_mask=attention_mask)
    if taken:
        owner.rows = [list(ids) for ids in taken]
    owner.version = generation  # keys the layout and metadata caches: the steps' layouts are made again
    owner.state = state
    owner.phases_done.discard("prefill")  # the prompt's pages are to be written by the import


# ---- imports --------------------------------------------------------------------------------------------------


def import_dense(runtime: Any, ticket: ImportTicket, kv: Any, *, rows: Sequence[int] | None = None,
                 first_page: int = 0, tokens: int | None = None, layout: str = "bshd",
                 heads: slice | Sequence[int] | None = None) -> None:
    """Write a producer's dense K/V into the ticket's pages and mark them ready.

    kv, by `layout`:
      * "bshd": per layer (K, V), each ``[rows, tokens, Hkv, D]`` (this package's dense caches, vllm-omni's cached
        prompt K/V);
      * "bhsd": per layer (K, V), each ``[rows, Hkv, tokens, D]`` (HF ``past_key_values``; a cache object with
        ``key_cache``/``value_cache`` lists or ``layers[i].keys/.values`` is read as that);
      * "rows": per layer a list over rows of (k, v), each ``[tokens, Hkv, D]`` or ``[tokens, Hkv * D]``
        (vllm-omni HunyuanImage-3's injected AR K/V, ``_injected_ar_kv``).
    rows: which of the request's rows the tensors' rows are (default: all, in order). Column j of a row holds
    prompt token ``first_page * block_size + j``; `tokens` of them are imported (default: the rest of the row's
    prompt), whole pages only unless they reach the prompt's end (a page is ready once all its tokens are). A
    left-padded producer: slice its rows first. heads: which of the producer's KV heads this pool holds (default:
    all, or the rank's tensor-parallel slice on a `RankRuntime`). Validated before anything is written: a refused
    import writes nothing and marks nothing.
    """

    def prepare(local: PagedKVRuntime) -> tuple[list[tuple], Callable[[list[int], torch.Tensor], None]]:
        owner = _live(local, ticket.request_id)
        chosen = _rows(owner, rows)
        per_row = _dense_rows(kv, layout, len(chosen), local.pool.head_dim)
        chosen_heads = _default_heads(runtime, local, per_row[0].shape[-2], heads)
        B = local.pool.block_size
        writes = []
        for r, row_kv in zip(chosen, per_row):
            p = ticket.tokens[r]
            start = first_page * B
            if not 0 <= start < p:
                raise RequestError(f"first_page={first_page} is outside row {r}'s {len(ticket.pages[r])} pages")
            n = p - start if tokens is None else tokens
            if n < 1 or start + n > p:
                raise RequestError(f"row {r}: tokens={n} from token {start} runs past its prompt of {p} tokens")
            if n % B and start + n != p:
                raise RequestError(
                    f"row {r}: {n} tokens from token {start} end inside a page (block_size {B}): import whole pages, "
                    "or up to the prompt's end (a page is marked ready once all its tokens are written)"
                )
            if row_kv.shape[2] < n:
                raise RequestError(f"row {r}: the producer gives {row_kv.shape[2]} tokens, {n} are imported")
            stored = _stored(local, _heads(row_kv[:, :, :n], chosen_heads), f"row {r}")
            writes.append((r, first_page, list(ticket.pages[r][first_page : first_page + -(-n // B)]), stored))
        return writes, local.pool.write_region

    _import(runtime, ticket, prepare, ("dense", None if rows is None else tuple(rows), first_page, tokens, layout))


def import_vllm_blocks(runtime: Any, ticket: ImportTicket, kv_caches: Sequence[Any],
                       block_tables: Sequence[Sequence[int]], *, rows: Sequence[int] | None = None,
                       heads: slice | Sequence[int] | None = None) -> None:
    """Copy a request's prompt from a vLLM KV cache's blocks into the ticket's pages and mark its rows ready.

    kv_caches: per layer vLLM's FlashAttention cache: ``[num_blocks, Hkv, block_size, 2 * D]`` (vLLM 0.32, K and V
    side by side), ``[2, num_blocks, block_size, Hkv, D]`` (earlier vLLM), or its (key_cache, value_cache) halves,
    each ``[num_blocks, block_size, Hkv, D]``; block_tables: per imported row (`rows`,
    default all) the vLLM block ids holding its prompt, from token 0, in order. Heads, head dim and dtype must be
    the pool's (heads after the `heads=` slice); with the pool's block size the blocks are copied page for page,
    with another one they are re-blocked on the host (one gather of the row's tokens). Refused, writing nothing,
    when the geometry differs (the reason named).
    """

    def prepare(local: PagedKVRuntime) -> tuple[list[tuple], Callable[[list[int], torch.Tensor], None]]:
        owner = _live(local, ticket.request_id)
        chosen = _rows(owner, rows)
        pool = local.pool
        if len(kv_caches) != pool.num_layers:
            raise RequestError(f"the vLLM cache has {len(kv_caches)} layers, the pool {pool.num_layers}")
        # per layer (K, V), each [num_blocks, Bv, H, D]
        caches = [_vllm_layer(c, l, pool.head_dim) for l, c in enumerate(kv_caches)]
        num_blocks, Bv, H, D = caches[0][0].shape
        if any(k.shape != caches[0][0].shape for k, _ in caches):
            raise RequestError("the vLLM cache's layers differ in shape: one geometry for all")
        chosen_heads = _default_heads(runtime, local, H, heads)
        if pool.scales is not None:
            raise RequestError("the pool stores FP8 with its own per-head scales: copying a vLLM cache's blocks "
                               "would need the producer's scales; import its K/V as dense tensors (import_dense)")
        if caches[0][0].dtype != pool.tensor.dtype:
            raise RequestError(f"the vLLM cache stores {caches[0][0].dtype}, the pool {pool.tensor.dtype}: cast on "
                               "the producer, or build the pool with that dtype")
        if len(block_tables) != len(chosen):
            raise RequestError(f"{len(block_tables)} block tables for {len(chosen)} rows: one per imported row")
        B = pool.block_size
        writes = []
        for r, table in zip(chosen, block_tables):
            p = ticket.tokens[r]
            ids = torch.as_tensor(list(table), dtype=torch.int64)
            if len(ids) * Bv < p:
                raise RequestError(f"row {r}: {len(ids)} vLLM blocks of {Bv} tokens hold fewer than its {p} prompt "
                                   "tokens")
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
                raise RequestError(f"row {r}: vLLM block ids must lie in [0, {num_blocks}), got {list(table)}")
            ids = ids[: -(-p // Bv)].to(caches[0][0].device)
            if Bv == B:  # page for page: (layers, 2, pages, B, H, D)
                kv = torch.stack([torch.stack([k[ids], v[ids]]) for k, v in caches])
            else:  # re-blocked: the row's tokens, (layers, 2, p, H, D)
                kv = torch.stack([torch.stack([k[ids].flatten(0, 1)[:p], v[ids].flatten(0, 1)[:p]])
                                  for k, v in caches])
            kv = _heads(kv, chosen_heads)
            _check_geometry(local, kv, f"row {r}")
            writes.append((r, 0, list(ticket.pages[r]), kv.to(pool.tensor.device)))
        if Bv == B:
            return writes, lambda pages, tiles: _copy_pages(pool, pages, tiles)
        return writes, pool.write_region

    _import(runtime, ticket, prepare, ("vllm_blocks", None if rows is None else tuple(rows)))


# ---- helpers ------------------------------------------------------------------------------------------------


def _local(runtime: Any) -> PagedKVRuntime:
    """The rank's own runtime of a `RankRuntime` (told by its `agreement`: no import of `distributed` here), or the
    runtime itself."""
    return runtime.runtime if hasattr(runtime, "agreement") else runtime


def _agreed(runtime: Any, operation: str, owner_id: str, args: Any, apply: Callable[[PagedKVRuntime], None],
            protect: Sequence[int] = ()) -> None:
    """Apply a call on this runtime; on a `RankRuntime` as a voted lifecycle call (put back on every rank if any
    refused; `protect`: local blocks whose bytes to put back too)."""
    if hasattr(runtime, "agreement"):
        runtime.agreed(operation, owner_id, args, lambda: apply(runtime.runtime), protect)
    else:
        apply(runtime)


def _check_idle(local: PagedKVRuntime) -> None:
    if local.active is not None or local.scheduler.in_flight is not None:
        raise RequestError("a forward is in flight on this runtime: reserve and import between forwards")


def _live(local: PagedKVRuntime, request_id: str) -> Owner:
    owner = local.scheduler.owners.get(request_id)
    if owner is None:
        why = local.scheduler.finished.get(request_id)
        raise RequestError(f"request {request_id!r} is {why or 'not admitted'}: reserve it (kv_import.reserve)")
    return owner


def _record(owner: Owner) -> ImportRecord | None:
    return getattr(owner.state, "imported", None)


def _current(local: PagedKVRuntime, ticket: ImportTicket) -> tuple[Owner, ImportRecord]:
    """The owner and record a ticket writes into, or a RequestError saying why the ticket is stale."""
    _check_idle(local)
    owner = local.scheduler.owners.get(ticket.request_id)
    if owner is None or owner.serial != ticket.serial:
        raise RequestError(
            f"the ticket of request {ticket.request_id!r} is stale: that admission "
            f"{'ended' if owner is None else 'ended and the id was admitted again'}; nothing was written"
        )
    record = _record(owner)
    if record is None:
        raise RequestError(f"the ticket of request {ticket.request_id!r} is stale: the request was reset or prefilled "
                           "itself since; nothing was written (kv_import.renew reserves again)")
    if record.generation != ticket.generation:
        raise RequestError(
            f"the ticket of request {ticket.request_id!r} is of generation {ticket.generation}, the reservation is "
            f"now generation {record.generation} (it was re-made): nothing was written; import with the current "
            "ticket (kv_import.ticket)"
        )
    return owner, record


def _rows(owner: Owner, rows: Sequence[int] | None) -> list[int]:
    rows = list(range(owner.num_rows)) if rows is None else [int(r) for r in rows]
    if not rows or len(set(rows)) != len(rows) or any(not 0 <= r < owner.num_rows for r in rows):
        raise RequestError(f"rows={rows}: pass distinct rows of the request, in [0, {owner.num_rows})")
    return rows


def _cache_pairs(kv: Any) -> Any:
    """An HF cache object as per-layer (K, V) pairs; anything else as it is."""
    if hasattr(kv, "key_cache") and hasattr(kv, "value_cache"):
        return list(zip(kv.key_cache, kv.value_cache))
    if hasattr(kv, "layers") and all(hasattr(x, "keys") and hasattr(x, "values") for x in kv.layers):
        return [(x.keys, x.values) for x in kv.layers]
    return kv


def _dense_rows(kv: Any, layout: str, rows: int, head_dim: int) -> list[torch.Tensor]:
    """Per imported row its K/V ``(layers, 2, tokens, H, D)``, from one of `DENSE_LAYOUTS`."""
    if layout not in DENSE_LAYOUTS:
        raise RequestError(f"unknown layout {layout!r}; use one of {DENSE_LAYOUTS}")
    layers = list(_cache_pairs(kv))
    if not layers:
        raise RequestError("the producer's K/V has no layers")
    out: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for l, layer in enumerate(layers):
        if layout == "rows":
            if len(layer) != rows:
                raise RequestError(f"layer {l} gives {len(layer)} rows of (k, v), {rows} are imported")
            for r, (k, v) in enumerate(layer):
                out[r].append(torch.stack([_tokens_heads_dim(k, l, r, head_dim), _tokens_heads_dim(v, l, r, head_dim)]))
            continue
        k, v = layer
        if k.dim() != 4 or k.shape != v.shape:
            raise RequestError(f"layer {l}: K {tuple(k.shape)} and V {tuple(v.shape)} must be one 4-D shape "
                               f"({'[rows, tokens, Hkv, D]' if layout == 'bshd' else '[rows, Hkv, tokens, D]'})")
        if layout == "bhsd":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if k.shape[0] != rows:
            raise RequestError(f"layer {l} holds {k.shape[0]} rows, {rows} are imported (pass rows=)")
        for r in range(rows):
            out[r].append(torch.stack([k[r], v[r]]))
    try:
        return [torch.stack(row) for row in out]
    except RuntimeError:
        shapes = sorted({tuple(t.shape) for row in out for t in row})
        raise RequestError(f"the producer's layers differ in shape ({shapes}): one geometry for all") from None


def _tokens_heads_dim(x: torch.Tensor, layer: int, row: int, head_dim: int) -> torch.Tensor:
    """One row's K or V of layout "rows" as [tokens, H, D] (vllm-omni reshapes its injected K/V so too)."""
    if x.dim() == 3:
        return x
    if x.dim() == 2 and x.shape[1] % head_dim == 0:
        return x.view(x.shape[0], -1, head_dim)
    raise RequestError(f"layer {layer}, row {row}: K/V of layout 'rows' are [tokens, Hkv, D] or [tokens, Hkv * D] "
                       f"(D = the pool's head dim {head_dim}), got {tuple(x.shape)}")


def _default_heads(runtime: Any, local: PagedKVRuntime, producer_heads: int,
                   heads: slice | Sequence[int] | None) -> slice | Sequence[int] | None:
    """The producer's KV heads this pool holds: the caller's, all of them, or a RankRuntime's TP slice."""
    mine = local.pool.num_kv_heads
    if heads is not None or producer_heads == mine:
        return heads
    parallel = getattr(runtime, "parallel", None)
    if parallel is not None and parallel.ulysses == 1 and producer_heads == mine * parallel.tensor_parallel:
        return slice(parallel.tp_rank * mine, (parallel.tp_rank + 1) * mine)
    raise RequestError(
        f"the producer gives {producer_heads} KV heads, this pool holds {mine}: pass heads= (which of the producer's "
        "heads this rank holds)"
    )


def _heads(kv: torch.Tensor, heads: slice | Sequence[int] | None, dim: int = -2) -> torch.Tensor:
    if heads is None:
        return kv
    if isinstance(heads, slice):
        index = torch.arange(kv.shape[dim])[heads]
    else:
        index = torch.as_tensor(list(heads), dtype=torch.int64)
    if len(index) == 0 or int(index.min()) < 0 or int(index.max()) >= kv.shape[dim]:
        raise RequestError(f"heads={heads} must select heads among the producer's {kv.shape[dim]}")
    return kv.index_select(dim % kv.dim(), index.to(kv.device))


def _check_geometry(local: PagedKVRuntime, kv: torch.Tensor, what: str) -> None:
    """Layers, KV heads and head dim of `kv` (layers, 2, ..., H, D) against the pool; floating and finite."""
    pool = local.pool
    if kv.shape[0] != pool.num_layers:
        raise RequestError(f"{what}: the producer gives {kv.shape[0]} layers, the pool holds {pool.num_layers}")
    if kv.shape[-2] != pool.num_kv_heads or kv.shape[-1] != pool.head_dim:
        raise RequestError(
            f"{what}: the producer's K/V has {kv.shape[-2]} KV heads x head dim {kv.shape[-1]}, the pool "
            f"{pool.num_kv_heads} x {pool.head_dim} (a tensor-parallel rank: pass heads=)"
        )
    if not kv.dtype.is_floating_point:
        raise RequestError(f"{what}: K/V must be floating, got {kv.dtype}")
    if not bool(torch.isfinite(kv).all()):
        raise RequestError(f"{what}: the producer's K/V holds NaN or inf; nothing was written")


def _stored(local: PagedKVRuntime, kv: torch.Tensor, what: str) -> torch.Tensor:
    _check_geometry(local, kv, what)
    return local.pool.to_stored(kv)


def _vllm_layer(cache: Any, layer: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a vLLM cache as (key_cache, value_cache) views, each ``[num_blocks, block_size, H, D]``.

    Read: vLLM 0.32's FlashAttention cache ``[num_blocks, Hkv, block_size, 2 * D]`` (K and V side by side in the
    last dim; its forward splits it so: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``), the earlier
    ``[2, num_blocks, block_size, Hkv, D]``, or the (key_cache, value_cache) halves themselves."""
    if isinstance(cache, torch.Tensor):
        if cache.dim() == 4:
            if cache.shape[-1] != 2 * head_dim:
                raise RequestError(
                    f"layer {layer}: a vLLM FlashAttention cache [num_blocks, Hkv, block_size, 2 * D] of shape "
                    f"{tuple(cache.shape)} holds head dim {cache.shape[-1] / 2:g}, the pool {head_dim}"
                )
            k, v = cache.transpose(1, 2).split(head_dim, dim=-1)
            return k, v
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise RequestError(
                f"layer {layer}: a vLLM cache of shape {tuple(cache.shape)} is not FlashAttention's layout "
                "([num_blocks, Hkv, block_size, 2 * D], or [2, num_blocks, block_size, Hkv, D] before vLLM 0.32; "
                "e.g. FlashInfer's [num_blocks, 2, ...] or an MLA cache is not): pass its (key_cache, value_cache) "
                "halves as [num_blocks, block_size, Hkv, D] views, or import dense K/V"
            )
        return cache[0], cache[1]
    k, v = cache
    if k.dim() != 4 or k.shape != v.shape:
        raise RequestError(f"layer {layer}: vLLM key/value caches must be [num_blocks, block_size, Hkv, D] each, got "
                           f"{tuple(k.shape)} and {tuple(v.shape)}")
    return k, v


def _copy_pages(pool: Any, pages: list[int], tiles: torch.Tensor) -> None:
    """Whole pages ``(layers, 2, len(pages), block_size, H, D)`` into local `pages` of every layer."""
    L, _, n = tiles.shape[:3]
    pool.tensor[:, pool.layer_block_ids(pages)] = tiles.transpose(0, 1).reshape(2, L * n, *tiles.shape[3:])


def _import(runtime: Any, ticket: ImportTicket, prepare: Callable[[PagedKVRuntime], tuple], what: tuple) -> None:
    """Validate (`prepare`: the rows' writes and the writer), then write every row and mark its pages ready: one
    call, voted on a RankRuntime (a refusal on any rank is every rank's; the ticket's pages put back)."""

    def apply(local: PagedKVRuntime) -> None:
        _, record = _current(local, ticket)
        writes, write = prepare(local)  # every check, before the first write
        for r, first, pages, stored in writes:
            write(pages, stored)
            record.ready[r][first : first + len(pages)] = [True] * len(pages)

    protect = sorted({b for pages in ticket.pages for b in pages})
    _agreed(runtime, "import", ticket.request_id, (ticket, what), apply, protect)
