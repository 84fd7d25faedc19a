"""The reference kernel against a dense oracle, opcheck of both ops, and rejected inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile.errors import OpInputError
from paged_kv_compile.ops import write_attend as wa

from _opcases import dense_oracle, expected_pool, make_case

write_attend = torch.ops.paged_kv.write_attend
attend = torch.ops.paged_kv.attend


@st.composite
def geometries(draw) -> dict:
    rows = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 5))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        hkv=draw(st.integers(1, 2)),
        ratio=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([4, 8])),
        block_size=draw(st.sampled_from([1, 3, 4, 8])),
        tokens=tokens,
        prefixes=draw(st.lists(st.integers(0, 11), min_size=rows, max_size=rows)),
        new_counts=draw(st.lists(st.integers(0, tokens), min_size=rows, max_size=rows)),
        modes=draw(st.lists(st.sampled_from(["full", "causal", "random", "padded"]), min_size=rows, max_size=rows)),
        right_aligned=draw(st.booleans()),
        extra_width=draw(st.integers(0, 2)),
        pad_random=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
        meta_layout=draw(st.sampled_from(["contiguous", "strided", "transposed"])),
    )


@pytest.mark.parametrize("host_lengths", [True, False], ids=["cpu-used-span", "device-path"])
@settings(max_examples=60, deadline=None)
@given(geometry=geometries())
def test_reference_matches_dense_oracle_and_writes_only_its_slots(host_lengths, geometry):
    """Both reference paths: the CPU one (lengths read on the host) and the device one (full table, mask)."""
    from paged_kv_compile.ops import reference

    previous, reference.HOST_LENGTHS_ON_CPU = reference.HOST_LENGTHS_ON_CPU, host_lengths
    try:
        _check_reference(geometry)
    finally:
        reference.HOST_LENGTHS_ON_CPU = previous


def _check_reference(geometry):
    case = make_case(**geometry)
    before = case.pool.clone()
    out = write_attend(*case.args(), case.scale, "reference")
    assert out.shape == case.query.shape and out.is_contiguous()
    torch.testing.assert_close(out, dense_oracle(case), atol=1e-5, rtol=0)
    assert torch.equal(case.pool, expected_pool(case, before)), "written slots must hold the new K/V, others untouched"
    empty = torch.minimum(case.kv_visible_end, case.seq_lens.view(-1, 1)) <= 0
    assert bool((out[empty] == 0).all()), "queries that see nothing give exact zeros"
    again = attend(case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale, "reference")
    assert torch.equal(again, out), "attend reads what write_attend wrote"


@pytest.mark.parametrize(
    "geometry",
    [
        dict(seed=0, hkv=2, ratio=2, block_size=4, tokens=3, prefixes=[5, 2], new_counts=[3, 1],
             modes=["causal", "random"]),
        dict(seed=1, hkv=1, ratio=4, block_size=3, tokens=2, prefixes=[0, 4], new_counts=[0, 2],
             modes=["padded", "full"], layout="transposed"),
    ],
)
def test_opcheck(geometry):
    case = make_case(**geometry)
    torch.library.opcheck(write_attend.default, (*case.args(), case.scale), {"kernel": "reference"})
    read_args = (case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale)
    torch.library.opcheck(attend.default, read_args, {"kernel": "reference"})


_ARG_NAMES = ("query", "key", "value", "pool", "slot_mapping", "block_table", "seq_lens", "kv_visible_end")


def _base():
    return make_case(seed=3, hkv=2, ratio=2, head_dim=8, block_size=4, tokens=3, prefixes=[5, 2],
                     new_counts=[3, 2], modes=["causal", "full"], extra_width=1, pad_random=False)


NB = 6 * 4  # the base case's pool has N=6 blocks of B=4 slots; its table is M=3 wide (12 slots)

BAD_INPUTS = [
    # (id, the argument to change, how, the message pattern)
    ("query rank", "query", lambda t: t[..., 0], r"query must have rank 4"),
    ("key rank", "key", lambda t: t[0], r"key must have rank 4"),
    ("pool rank", "pool", lambda t: t[0], r"kv_pool must have rank 5"),
    ("slot_mapping rank", "slot_mapping", lambda t: t[0], r"slot_mapping must have rank 2"),
    ("block_table rank", "block_table", lambda t: t[0], r"block_table must have rank 2"),
    ("seq_lens rank", "seq_lens", lambda t: t[None], r"seq_lens must have rank 1"),
    ("visible_end rank", "kv_visible_end", lambda t: t[0], r"kv_visible_end must have rank 2"),
    ("integer query", "query", lambda t: t.int(), r"query must be a floating dtype"),
    ("key dtype", "key", lambda t: t.double(), r"key is torch.float64 but query is torch.float32"),
    ("pool dtype", "pool", lambda t: t.half(), r"kv_pool is torch.float16 but query"),
    ("slot_mapping dtype", "slot_mapping", lambda t: t.int(), r"slot_mapping must be torch.int64"),
    ("block_table dtype", "block_table", lambda t: t.long(), r"block_table must be torch.int32"),
    ("seq_lens dtype", "seq_lens", lambda t: t.long(), r"seq_lens must be torch.int32"),
    ("visible_end dtype", "kv_visible_end", lambda t: t.long(), r"kv_visible_end must be torch.int32"),
    ("pool device", "pool", lambda t: t.to("meta"), r"kv_pool is on meta but query is on cpu"),
    ("key device", "key", lambda t: t.to("meta"), r"key is on meta but query is on cpu"),
    ("heads not a multiple", "query", lambda t: t[:, :, :3], r"Hq=3 are not a multiple of the pool's kv heads Hkv=2"),
    ("head_dim", "query", lambda t: t[..., :6], r"head_dim mismatch: query has D=6, kv_pool has D=8"),
    ("key kv heads", "key", lambda t: t[:, :, :1], r"key has shape .*pool Hkv/D must match"),
    ("value rows", "value", lambda t: t[:1], r"value has shape \(1, 3, 2, 8\), expected"),
    ("slot_mapping rows", "slot_mapping", lambda t: t[:1], r"slot_mapping has shape \(1, 3\), expected \(2, 3\)"),
    ("visible_end tokens", "kv_visible_end", lambda t: t[:, :2], r"kv_visible_end has shape \(2, 2\)"),
    ("block_table rows", "block_table", lambda t: t[:1], r"block_table has shape \(1, 3\), expected \[R=2"),
    ("pool not contiguous", "pool", lambda t: t.transpose(3, 4).contiguous().transpose(3, 4),
     r"kv_pool must be contiguous"),
    ("slot beyond pool", "slot_mapping", lambda t: t.clone().fill_(NB),
     rf"slot_mapping\[0, 0\] = {NB} is outside \[-1, N\*B={NB}\)"),
    ("slot below -1", "slot_mapping", lambda t: t.clone().fill_(-2), r"slot_mapping\[0, 0\] = -2 is outside"),
    ("slot written twice", "slot_mapping", lambda t: t.clone().fill_(5), r"writes slot 5 twice"),
    ("block id beyond pool", "block_table", lambda t: t.clone().fill_(6),
     r"block_table\[0, 0\] = 6 is outside \[0, N=6\)"),
    ("negative block id", "block_table", lambda t: t.clone().fill_(-1), r"block_table\[0, 0\] = -1 is outside"),
    ("seq_len beyond table", "seq_lens", lambda t: torch.tensor([13, 2], dtype=torch.int32),
     r"seq_lens\[0\] = 13 is outside \[0, M\*B=12\].*widen block_table"),
    ("visible_end beyond seq_len", "kv_visible_end", lambda t: t.clone().fill_(9),
     r"kv_visible_end\[0, 0\] = 9 is outside \[0, seq_lens"),
    ("negative visible_end", "kv_visible_end", lambda t: t.clone().fill_(-1),
     r"kv_visible_end\[0, 0\] = -1 is outside"),
]


@pytest.mark.parametrize("arg, change, pattern", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_rejected_inputs_name_the_problem_and_leave_the_pool_unchanged(arg, change, pattern):
    case = _base()
    assert case.pool.shape[1:3] == (6, 4) and case.block_table.shape == (2, 3)
    args = dict(zip(_ARG_NAMES, case.args()))
    args[arg] = change(args[arg])
    before = case.pool.clone()
    with pytest.raises(OpInputError, match=pattern):
        write_attend(*args.values(), case.scale, "reference")
    assert torch.equal(case.pool, before)


def test_attend_validates_too():
    case = _base()
    with pytest.raises(OpInputError, match=r"kv_pool must have rank 5"):
        attend(case.query, case.pool[0], case.block_table, case.seq_lens, case.kv_visible_end, case.scale)


def test_unknown_visibility_and_a_wrong_hint_are_rejected():
    case = _base()  # row 0 is causal, row 1 sees everything
    with pytest.raises(OpInputError, match=r"unknown visibility 'sliding'"):
        write_attend(*case.args(), case.scale, "reference", visibility="sliding")
    before = case.pool.clone()
    with pytest.raises(OpInputError, match=r"kv_visible_end\[0, 0\] = 6 is not what the visibility='full' hint"):
        write_attend(*case.args(), case.scale, "reference", visibility="full")
    assert torch.equal(case.pool, before)


def test_value_checks_can_be_turned_off(monkeypatch):
    case = _base()
    monkeypatch.setattr(wa, "CHECK_VALUES", False)
    ends = case.kv_visible_end.clone().fill_(9)  # beyond seq_len: clamped by the kernel, rejected by the checks
    out = write_attend(*case.args()[:-1], ends, case.scale, "reference")
    assert out.shape == case.query.shape


def test_a_call_without_gradients_skips_custom_ops_python_layers_and_still_bumps_the_pool_version(monkeypatch):
    """`write_attend._lean_autograd`: a call where no input needs a gradient goes from one Python Autograd
    kernel straight to the backend, so `custom_op`'s ADInplaceOrView layer is never reached (its version bump,
    `torch._library.custom_ops.increment_version`, is the probe: torch 2.13 and 2.14 both call it there; 2.13
    also rebuilt the argument list with `fill_defaults` in that layer, 2.14 no longer does); the pool's version
    counter still moves (it is the op's one mutated argument) and the output is the same as the reference
    kernel's. With an input that requires grad, `custom_op`'s own layers run (the output carries a grad_fn
    whose backward says no formula is registered)."""
    import torch._library.custom_ops as custom_ops
    import torch._library.utils as library_utils

    assert set(wa.AUTOGRAD_KERNELS) == {"write_attend", "attend"}, "the lean kernels are registered on this torch"
    layer, filled = [], []
    real_bump, real_fill = custom_ops.increment_version, library_utils.fill_defaults
    monkeypatch.setattr(custom_ops, "increment_version", lambda v: layer.append(1) or real_bump(v))
    monkeypatch.setattr(library_utils, "fill_defaults", lambda *a: filled.append(1) or real_fill(*a))
    case = make_case(seed=3, hkv=1, ratio=2, block_size=4, tokens=3, prefixes=[5, 2], new_counts=[3, 1],
                     modes=["causal", "full"])
    before, version = case.pool.clone(), case.pool._version
    out = write_attend.default(*case.args(), case.scale, "reference")
    assert layer == [] and filled == [], "custom_op's ADInplaceOrView layer ran"
    assert case.pool._version > version, "the pool's version counter must move"
    torch.testing.assert_close(out, dense_oracle(case), atol=1e-5, rtol=0)
    assert torch.equal(case.pool, expected_pool(case, before))
    with wa.custom_op_layers():  # what benchmarks/forward_time.py --op-overhead compares against
        version = case.pool._version
        write_attend.default(*case.args(), case.scale, "reference")
        assert case.pool._version > version
    assert layer, "inside custom_op_layers the ops run through custom_op's own layers"
    layer.clear()
    write_attend.default(*case.args(), case.scale, "reference")
    assert layer == [], "custom_op_layers restores the lean kernel"

    case = make_case(seed=3, hkv=1, ratio=2, block_size=4, tokens=3, prefixes=[5, 2], new_counts=[3, 1],
                     modes=["causal", "full"])
    args = list(case.args())
    args[0] = args[0].clone().requires_grad_()
    out = write_attend.default(*args, case.scale, "reference")
    assert layer, "with a gradient needed, custom_op's own layers run"
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


def test_the_lean_kernel_is_left_out_on_a_torch_without_its_internals(monkeypatch):
    """Where `torch._library.autograd.make_autograd_impl` is absent (another torch), `_lean_autograd` leaves
    `custom_op`'s registration as it was: the op still runs and bumps its mutated argument's version."""
    import torch._library.autograd as library_autograd

    @torch.library.custom_op("paged_kv_test::add_one_", mutates_args=("x",))
    def add_one_(x: torch.Tensor) -> None:
        x.add_(1)

    monkeypatch.delattr(library_autograd, "make_autograd_impl")
    kernels = dict(wa.AUTOGRAD_KERNELS)
    wa._lean_autograd(add_one_)
    assert wa.AUTOGRAD_KERNELS == kernels, "nothing is registered without the internals"
    x = torch.zeros(3)
    version = x._version
    add_one_(x)
    assert torch.equal(x, torch.ones(3)) and x._version > version


def _torch_checks_pass(monkeypatch, args) -> bool:
    with monkeypatch.context() as m:
        m.setattr(wa, "_values_ok", lambda *a: False)  # the torch checks alone
        try:
            wa.check_values(*args)
        except OpInputError:
            return False
    return True


def test_the_host_value_check_passes_exactly_what_the_torch_checks_pass(monkeypatch):
    """`write_attend._values_ok` (numpy, every CPU call) must never pass metadata the torch checks refuse, nor
    refuse what they pass: random valid metadata of each visibility, then each array with each boundary value
    at a random entry."""
    import itertools

    import numpy as np

    rng = np.random.default_rng(0)
    N, B, M = 6, 4, 3
    verdicts = set()
    corruptions = [(None, None)] * 8 + list(itertools.product(
        ["slots", "table", "seq", "vis"], [-2, -1, 0, 1, N - 1, N, N * B - 1, N * B, M * B, M * B + 1, "dup"]))
    for visibility, (corrupt, value) in itertools.product(["general", "full", "causal"], corruptions):
        R, T = int(rng.integers(1, 4)), int(rng.integers(2, 7))
        seq = rng.integers(T, M * B + 1, size=R)
        t = np.arange(T)
        vis = {"general": rng.integers(0, seq[:, None] + 1, size=(R, T)), "full": np.repeat(seq[:, None], T, 1),
               "causal": seq[:, None] - T + t + 1}[visibility]
        slots = rng.permutation(N * B)[: R * T].reshape(R, T)
        slots[rng.random((R, T)) < 0.2] = -1
        arrays = {"slots": slots, "table": rng.integers(0, N, size=(R, M)), "seq": seq, "vis": vis}
        if corrupt is not None:
            flat = arrays[corrupt].reshape(-1)
            flat[rng.integers(flat.size)] = flat[0] if value == "dup" else value
        args = (torch.zeros(R, T, 1, 2), torch.zeros(2, N, B, 1, 2), torch.from_numpy(slots.astype(np.int64)),
                torch.from_numpy(arrays["table"].astype(np.int32)), torch.from_numpy(seq.astype(np.int32)),
                torch.from_numpy(vis.astype(np.int32)), visibility)
        want = _torch_checks_pass(monkeypatch, args)
        assert wa._values_ok(*args) == want, (visibility, corrupt, value, arrays)
        verdicts.add(want)
    assert verdicts == {True, False}
