"""Blocks that repeat with a period (`hspmd.frontend.torch_repeats`): the importer exports the
first blocks of a ModuleList (those before the repeats, a period and the next block), calls the
others as the exported block at their place in the pattern, and computes PyTorch's numbers, its
layers stacked a period per scan iteration (`stack-layers`); where the blocks' graphs do not
repeat after all (a block computing with its own number), it exports every block."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_imported

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402
from hspmd.frontend.torch_repeats import (  # noqa: E402
    ExportedCalls, RepeatPattern, pattern_of, repeat_pattern, repeatable_lists)


def _holds(items, start, period) -> bool:
    return all(items[i] == items[i + period] for i in range(start, len(items) - period))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=4), st.lists(st.integers(0, 2), min_size=1, max_size=4),
       st.integers(0, 14))
def test_the_pattern_found_holds_and_is_the_shortest(prefix, period_items, more):
    items = prefix + [period_items[i % len(period_items)] for i in range(len(period_items) + more)]
    start, period = repeat_pattern(items)
    assert _holds(items, start, period)
    shortest = min([(s + 2 * p, p) for p in range(1, len(items) + 1) for s in range(len(items) + 1)
                    if _holds(items, s, p) and s + 2 * p <= len(items)], default=None)
    assert (start + 2 * period, period) == shortest if shortest else (start, period) == (len(items), 1)
    pattern = pattern_of(items)
    assert (pattern.start, pattern.period) == (start, period)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_the_export_keeps_one_block_per_kind_and_calls_the_others_as_one_before(items):
    pattern, kept = pattern_of(items), pattern_of(items).blocks
    assert {items[k] for k in kept} == set(items) and kept[0] == 0
    repeats = len(set(items)) < len(items)
    first_again = items.count(items[0]) > 1
    assert len(kept) == len(set(items)) + first_again  # one per kind, and a second of the first block's
    if repeats:
        a, b = pattern.checked
        assert items[a] == items[b] and a < b and a in kept
        # the first block's kind: its second block is the template (kept, its graph compared);
        # another kind: its first block is, and the second is compared eagerly (left out)
        assert (b in kept) == first_again and (pattern.eager_checked == (a, b)) == (not first_again)
    for k in set(range(len(items))) - set(kept):  # a block left out is called as an exported block before it
        t = pattern.template(k)
        assert items[t] == items[k] and t in kept and 0 < t < k
    left = ExportedCalls(list(range(len(items)))).left_out(kept)  # a loop calling every block
    assert sorted([*kept, *(k for ks in left.values() for k in ks)]) == list(range(len(items)))
    assert all(a in kept and min(ks) > a for a, ks in left.items())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_with_per_layer_values_two_blocks_of_every_kind_that_repeats_are_kept(items):
    pattern = RepeatPattern(pattern_of(items).kinds, ("scale",))
    kept = pattern.blocks
    repeating = {x for x in items if items.count(x) > 1}
    assert {items[k] for k in kept} == set(items) and len(kept) == len(set(items)) + len(repeating)
    assert sorted(items[a] for a, _ in pattern.pairs) == sorted(repeating)
    for k in set(range(len(items))) - set(kept):  # called as the second kept block of its kind
        t = pattern.template(k)
        assert items[t] == items[k] and t in kept and 0 < t < k and any(t == b for _, b in pattern.pairs)


class Block(torch.nn.Module):
    def __init__(self, kind: str, layer_idx: int, by_depth: bool) -> None:
        super().__init__()
        self.kind, self.layer_idx, self.by_depth = kind, layer_idx, by_depth
        self.fc = torch.nn.Linear(8, 8)
        if kind in "pq":  # a constant table, other values per kind (Gemma-3's local and global rotary tables)
            self.register_buffer("table", torch.arange(8.0) * (0.1 if kind == "p" else -0.2), persistent=False)

    def forward(self, x, bias):
        y = self.fc(x) + (bias if self.kind != "c" else 0.0) + (self.table if self.kind in "pq" else 0.0)
        y = torch.tanh(y) if self.kind in "apq" else torch.nn.functional.gelu(y)
        return x + (y * (self.layer_idx + 1) if self.by_depth else y)


class Net(torch.nn.Module):
    def __init__(self, kinds: str, by_depth: bool = False) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(8) * 0.1)
        self.blocks = torch.nn.ModuleList(Block(k, i, by_depth) for i, k in enumerate(kinds))

    def forward(self, batch):
        x, bias = batch["x"], self.bias * 2
        for block in self.blocks:
            x = block(x, bias)
        return (x ** 2).mean()


def _imported(model):
    """Return (the import of `model`'s loss on a batch, the batch)."""
    batch = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    return hs.from_torch(model, batch, lambda m, b: m(b)), batch


def _agrees(model, batch, out, grads: bool = True) -> None:
    """Assert that `out` (the imported program's outputs on `batch`) has PyTorch's loss (1e-6)
    and, with `grads`, every gradient (1e-5)."""
    loss = model({"x": torch.as_tensor(batch["x"])})
    assert abs(float(out["loss"]) - loss.item()) <= 1e-6 * abs(loss.item())
    if grads:
        loss.backward()
        for name, p in model.named_parameters():
            g = p.grad.numpy()
            assert np.linalg.norm(out[f"grad:{name}"] - g) <= 1e-5 * np.linalg.norm(g), name


# stacked: (layers per scan iteration, iterations) of each scan `stack-layers` makes, the calls left
@pytest.mark.parametrize("kinds,by_depth,repeated,stacked", [
    ("abababa", False, pattern_of("abababa"), ([(2, 3)], 1)),  # two kinds taking turns (sliding, full attention)
    ("cbbbbbb", False, pattern_of("cbbbbbb"), ([(1, 6)], 1)),  # a first block of its own (a dense layer)
    ("abcabcab", False, pattern_of("abcabcab"), ([(3, 2)], 2)),
    ("ppqppqp", False, pattern_of("ppqppqp"), ([(1, 7)], 0)),  # alike but for a table: one function, period 1
    ("aaabaaabaaab", False, pattern_of("aaab" * 3), ([(4, 3)], 0)),  # 3 kept (Cohere-2's NoPE layers)
    ("aabaaaabaaaaaa", False, pattern_of("aabaaaabaaaaaa"), ([(5, 2), (1, 4)], 0)),  # kinds at a list of places (Mllama)
    ("aaaaaa", True, None, ([], 6)),  # each block scales by its number: the graphs differ, every block is exported
    ("cbbbbbb", True, None, ([], 7)),  # so, compared eagerly (blocks 1 and 2: only 1 is exported)
])
def test_repeating_blocks_import_with_pytorchs_numbers(kinds, by_depth, repeated, stacked):
    """... and with their layers stacked: a period of blocks is one scan iteration."""
    torch.manual_seed(0)
    model = Net(kinds, by_depth)
    program, batch = _imported(model)
    assert program.repeated == ({"blocks": repeated} if repeated else {})
    from xdsl.dialects import func

    calls = [o for o in program.module.walk() if isinstance(o, func.CallOp)]
    assert len(calls) == len(kinds)
    assert len({c.callee.root_reference.data for c in calls}) == (len(set(kinds)) if not by_depth else len(kinds))
    out = run_imported(program, batch, stack=True)
    from hspmd.dialects import graph

    funcs = {o.sym_name.data: o for o in program.module.walk() if isinstance(o, func.FuncOp)}
    scans = [o for o in program.module.walk() if isinstance(o, graph.ScanOp) and not o.is_reverse]

    def layers(name: str) -> int:  # the layers a function computes: its tanh and gelu ops, its calls' too
        return sum(isinstance(o, graph.TanhOp) or o.name == "graph.gelu" for o in funcs[name].walk()) + sum(
            layers(o.callee.root_reference.data) for o in funcs[name].walk() if isinstance(o, func.CallOp))

    per = [layers(s.callee.root_reference.data) for s in scans]
    assert ([(p, s.num_iterations) for p, s in zip(per, scans)], sum(
        1 for o in funcs["train_step"].walk() if isinstance(o, func.CallOp) and "bwd" not in o.callee.root_reference.data)
    ) == stacked
    _agrees(model, batch, out)


class Typed(Net):
    """Alike blocks that the model's loop treats by the config's per-layer list, read at the loop's
    place (transformers' `config.layer_types[i]`): the export, which keeps blocks 0, 1 and 3 of
    "sssf" * 3, must cut the list as it cuts the blocks."""

    def __init__(self) -> None:
        super().__init__("a" * 12)
        self.config = __import__("types").SimpleNamespace(layer_types=["s", "s", "s", "f"] * 3)

    def forward(self, batch):
        x, bias = batch["x"], self.bias * 2
        for i, block in enumerate(self.blocks):
            x = block(x, bias if self.config.layer_types[i] == "s" else -bias)
        return (x ** 2).mean()


def test_a_per_layer_list_read_at_the_loops_place_is_cut_as_the_blocks():
    torch.manual_seed(0)
    model = Typed()
    program, batch = _imported(model)
    assert program.repeated == {"blocks": pattern_of("aaab" * 3)}
    assert program.repeated["blocks"].blocks == (0, 1, 3)
    assert model.config.layer_types == ["s", "s", "s", "f"] * 3 and len(model.blocks) == 12  # restored
    out = run_imported(program, batch, stack=True)
    _agrees(model, batch, out)


class Between(Net):
    """Alike blocks with a value computed between each two by the model's loop: the blocks left
    out would skip it, so every block is exported."""

    def forward(self, batch):
        x, bias = batch["x"], self.bias * 2
        for block in self.blocks:
            x = block(x, bias) * 0.5
        return (x ** 2).mean()


class KeepAll(Net):
    """Alike blocks whose every result the loss reads (as a loop keeping `all_hidden_states`
    does): the blocks left out would not be in it, so every block is exported (this was a wrong
    loss, silently, before the importer checked who reads the blocks' values)."""

    def forward(self, batch):
        x, bias, kept = batch["x"], self.bias * 2, 0.0
        for block in self.blocks:
            x = block(x, bias)
            kept = kept + x.mean()
        return (x ** 2).mean() + kept


@pytest.mark.parametrize("net,grads", [(Between, False), (KeepAll, True)])
def test_a_loop_computing_between_blocks_or_reading_each_blocks_result_exports_every_block(net, grads):
    torch.manual_seed(0)
    model = net("a" * 6)
    program, batch = _imported(model)
    assert program.repeated == {}
    out = run_imported(program, batch, stack=True)
    _agrees(model, batch, out, grads=grads)


class Pair(Block):
    """A block handing on a second value the next block takes by keyword (GLM-MoE-DSA's top-k
    indices, `prev_topk_indices`); `uses` whether it computes with it."""

    def __init__(self, uses: bool) -> None:
        super().__init__("a", 0, False)
        self.uses = uses

    def forward(self, x, bias, prev=None):
        y = x + torch.tanh(self.fc(x) + bias + (prev.float() if self.uses and prev is not None else 0.0))
        return y, (y > 0).long()


class Pairs(Net):
    def __init__(self, uses: bool) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList(Pair(uses) for _ in range(6))

    def forward(self, batch):
        x, bias, prev = batch["x"], self.bias * 2, None
        for block in self.blocks:
            x, prev = block(x, bias, prev=prev)
        return (x ** 2).mean()


@pytest.mark.parametrize("uses,repeated", [(False, True), (True, False)])
def test_blocks_handing_on_two_values(uses, repeated):
    """The stand-ins hand the second value on as the blocks take it; where a block computes
    with it (two values carried), every block is exported."""
    torch.manual_seed(0)
    model = Pairs(uses)
    program, batch = _imported(model)
    assert bool(program.repeated) == repeated
    out = run_imported(program, batch, stack=True)
    _agrees(model, batch, out)


class Weighted(Block):
    """A block returning a second value no block takes (attention weights) that the loop may use."""

    def forward(self, x, bias):
        y = Block.forward(self, x, bias)
        return y, torch.softmax(y, -1)


class Tail(Net):
    """Alike blocks but the last (GPT-NeoX-Japanese's last layer has a bias of its own), each
    returning (hidden, weights); `collect`: the loss also reads every block's weights."""

    def __init__(self, collect: bool) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList(Weighted(k, i, False) for i, k in enumerate("aaaaab"))
        self.collect = collect

    def forward(self, batch):
        x, bias, extra = batch["x"], self.bias * 2, 0.0
        for block in self.blocks:
            x, weights = block(x, bias)
            extra = extra + (weights.mean() if self.collect else 0.0)
        return (x ** 2).mean() + extra


@pytest.mark.parametrize("collect", [False, True])
def test_a_last_block_of_its_own_and_a_second_value_no_block_takes(collect):
    """The last block is a kind of its own (kept); the stand-ins hand on a placeholder for the
    weights, and where the loss reads them every block is exported."""
    torch.manual_seed(0)
    model = Tail(collect)
    program, batch = _imported(model)
    assert program.repeated == ({} if collect else {"blocks": pattern_of("aaaaab")})
    out = run_imported(program, batch, stack=True)
    _agrees(model, batch, out)


class Skipped(Block):
    """A block the loop skips by its class (Mllama's text loop skips its cross-attention layers)."""


class Skipping(Net):
    def __init__(self) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList((Skipped if k == "c" else Block)(k, i, False) for i, k in enumerate("aacaacaa"))

    def forward(self, batch):
        x, bias = batch["x"], self.bias * 2
        for block in self.blocks:
            if isinstance(block, Skipped):
                continue
            x = block(x, bias)
        return (x ** 2).mean()


def test_a_loop_that_skips_blocks_by_their_class_sees_the_stand_ins_as_them():
    torch.manual_seed(0)
    model = Skipping()
    program, batch = _imported(model)
    assert program.repeated == {"blocks": pattern_of("aacaacaa")}
    out = run_imported(program, batch, stack=True)
    _agrees(model, batch, out, grads=False)


class Numbered(torch.nn.Module):
    """A block holding settings that count with its number (Beam's residual-add indices, BigBird's
    seed) besides one that does not."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.add_idx, self.seed, self.width = 2 * i + 3, i, 8
        self.fc = torch.nn.Linear(8, 8)


def test_settings_that_count_with_the_block_number_do_not_break_the_repeats():
    blocks = torch.nn.Module()
    blocks.layers = torch.nn.ModuleList(Numbered(i) for i in range(6))
    per_layer = lambda items: RepeatPattern(pattern_of(items).kinds, ("add_idx",))  # noqa: E731
    assert repeatable_lists(blocks) == {"layers": per_layer("aaaaaa")}
    # a config list of layer numbers as long as the blocks (Llama-4's `moe_layers`) is no setting per layer
    blocks.config = __import__("types").SimpleNamespace(moe_layers=list(range(6)), kinds=["s", "f"] * 3)
    assert repeatable_lists(blocks) == {"layers": per_layer("ababab")}
    blocks.layers[4].width = 9  # a setting that differs otherwise: block 4 is a kind of its own
    assert repeatable_lists(blocks) == {"layers": per_layer("ababcb")}
    for block, width in zip(blocks.layers, (8, 9, 11, 14, 18, 23)):  # each a kind of its own: nothing to cut
        block.width = width
    assert repeatable_lists(blocks) == {}


class Scaled(Block):
    """A block computing with numbers of its layer: a float setting made from its number
    (DiffLlama's `lambda_init`), an integer counting with it (Beam's residual-add index), a buffer
    of its own (MiniMax's decay rates); "clash": block 0's number is also a constant every block
    takes, so the importer cannot tell it by its value."""

    def __init__(self, how: str, i: int) -> None:
        super().__init__("a", i, False)
        self.how = how
        if how == "float":
            self.lam = 0.8 - 0.6 * math.exp(-0.3 * i)
        elif how == "count":
            self.add_idx = 2 * (i + 1)
        elif how == "buffer":
            self.register_buffer("rate", torch.linspace(0.1, 1.0, 8) * (1 - i / 10), persistent=False)
        else:
            self.lam = 0.5 + 0.1 * i

    def forward(self, x, bias):
        y = torch.tanh(self.fc(x) + bias)
        if self.how == "float":
            return x + y * (1 - self.lam) + self.lam
        if self.how == "count":
            return x * math.sqrt((self.add_idx - 1) / self.add_idx) + y / math.sqrt(self.add_idx)
        if self.how == "buffer":
            return x + y * torch.exp(-self.rate)
        return x + y * self.lam + 0.5


class ScaledNet(Net):
    def __init__(self, how: str, layers: int = 6) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList(Scaled(how, i) for i in range(layers))


@pytest.mark.parametrize("how,per_layer", [("float", ("lam",)), ("count", ("add_idx",)), ("buffer", ("rate",)),
                                           ("clash", None)])
def test_blocks_computing_with_numbers_of_their_layer_take_them_as_inputs(how, per_layer):
    """Each block's own numbers are inputs of the one function the blocks share, stacked with the
    layers (one scan of 6); where a number cannot be told by its value, every block is exported."""
    torch.manual_seed(0)
    model = ScaledNet(how)
    program, batch = _imported(model)
    assert program.repeated == ({"blocks": RepeatPattern((0,) * 6, per_layer)} if per_layer else {})
    from xdsl.dialects import func

    from hspmd.dialects import graph

    calls = [o for o in program.module.walk() if isinstance(o, func.CallOp)]
    assert len(calls) == 6 and len({c.callee.root_reference.data for c in calls}) == (1 if per_layer else 6)
    _agrees(model, batch, run_imported(program, batch))
    program, _ = _imported(model)
    out = run_imported(program, batch, stack=True)
    scans = [o for o in program.module.walk() if isinstance(o, graph.ScanOp) and not o.is_reverse]
    assert [s.num_iterations for s in scans] == ([6] if per_layer else [])
    model.zero_grad()
    _agrees(model, batch, out)


class Drifting(Scaled):
    """A block that updates a buffer (as BatchNorm's running statistics) and draws random numbers."""

    def forward(self, x, bias):
        self.rate.add_(1.0)
        return torch.nn.functional.dropout(super().forward(x, bias), 0.1)


def test_the_eager_run_that_records_the_floats_leaves_buffers_and_random_state_as_they_were():
    from hspmd.frontend.torch_layer_values import record_floats

    model = ScaledNet("buffer", 3)
    model.blocks = torch.nn.ModuleList(Drifting("buffer", i) for i in range(3))
    rates, rng = [b.rate.clone() for b in model.blocks], torch.random.get_rng_state()
    record = record_floats(model, lambda: model({"x": torch.ones(4, 8)}), model.blocks)
    assert all(torch.equal(b.rate, r) for b, r in zip(model.blocks, rates))
    assert torch.equal(torch.random.get_rng_state(), rng)
    # the blocks run one sequence of ops, dropout's `1 - p` among their floats, none of them a block's own
    assert record.ops[0] == record.ops[2] and 0.9 in record.floats[1] and record.varying([0, 1, 2]) == []


@pytest.mark.parametrize("strategy,n", [("[0,1]: pp=2", 2), ("[0,1]: dp=2", 2)])
def test_layers_with_numbers_of_their_own_train_as_on_one_device(strategy, n, tmp_path):
    """Stacked, the per-layer numbers, the bias's gradient summed over the layers and each layer's
    0-d scalar cut into pipeline stages (`cut-stacked-layers`) and run there: the gradients are
    one device's."""
    import os

    from hspmd.compiler import compile_script, write_bundle
    from hspmd.frontend.script import load_script
    from hspmd.runtime.comm import run_spmd
    from hspmd.runtime.worker import train

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_scripts", "layer_numbers.py")

    def grads(strategy: str, n: int) -> dict:
        s = load_script(script)
        bundle = str(tmp_path / f"b{n}")
        write_bundle(compile_script(s, strategy, n, optimizer=False, stack_layers=True), bundle)
        ranks = run_spmd(n, lambda c: train(bundle, c, steps=1, quiet=True, keep_outputs=True), timeout=300)
        assert s.imported.repeated["blocks"].per_layer == ("lam",)
        return {k: v for r in ranks for k, v in r.outputs[0].items() if k.startswith("grad:")}

    one, many = grads("[0]: dp=1", 1), grads(strategy, n)
    assert sorted(one) == sorted(many) and len(one) == 1 + 4 * 6
    for k in one:
        assert np.allclose(many[k], one[k], rtol=1e-5, atol=1e-7), k


class Mixing(Block):
    """A block whose product takes a buffer (MiniMax's decays): under autocast both operands of
    the matmul are cast to 16 bits, the concrete buffer as well."""

    def __init__(self, i: int) -> None:
        super().__init__("a", i, False)
        self.register_buffer("mix", torch.eye(8) * (1 - i / 10) + 0.01, persistent=False)

    def forward(self, x, bias):
        return x + torch.matmul(torch.tanh(self.fc(x) + bias), self.mix)


@pytest.mark.parametrize("repeat", [True, False])
def test_a_buffer_a_product_takes_is_cast_as_autocast_casts_it(repeat):
    torch.manual_seed(0)
    model = Net("")
    model.blocks = torch.nn.ModuleList(Mixing(i) for i in range(4))
    batch = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    program = hs.from_torch(model, batch, lambda m, b: m(b), repeat_blocks=repeat, precision="bfloat16")
    assert bool(program.repeated) == repeat  # the buffers per layer: inputs of the blocks' function
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model({"x": torch.as_tensor(batch["x"])}).item()
    assert abs(float(run_imported(program, batch)["loss"]) / loss - 1) <= 1e-2


class Indexed(Block):
    """A block of HY-v4's kinds: "f" picks the top-k features of its input (int indices), "s"
    (shared) takes the indices of the block before and hands them on untouched, "g" is "f" of
    another activation (HY-v4's first, dense layer); each computes through a mask made from the
    indices."""

    def forward(self, x, bias, prev=None):
        index = torch.topk(x * self.fc.weight[0], 3, dim=-1).indices if self.kind in "fg" else prev
        mask = torch.zeros_like(x).scatter(-1, index, 1.0)
        act = torch.nn.functional.gelu if self.kind == "g" else torch.tanh
        return x + act(self.fc(x) * mask + bias), index


class IndexedNet(Net):
    def __init__(self, kinds: str, keep: bool = False) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList(Indexed(k, i, False) for i, k in enumerate(kinds))
        self.keep = keep  # the loss reads every block's result, as `output_hidden_states` keeps them

    def forward(self, batch):
        x, bias, index, kept = batch["x"], self.bias * 2, None, 0.0
        for block in self.blocks:
            x, index = block(x, bias, prev=index)
            kept = kept + (x.mean() if self.keep else 0.0)
        return (x ** 2).mean() + kept


@pytest.mark.parametrize("kinds,keep,repeated", [
    ("gfsssfsssfss", False, True),  # the indices of the last "f" block, handed on through "s" blocks (HY-v4)
    ("fsssfsssfss", False, True),
    ("fsfsfsfs", False, True),
    ("ffsssfsssfss", False, False),  # block 0's indices no block takes: its graph is not block 1's
    ("fsssfsssfss", True, False),  # the loss reads every block's result: the blocks left out would miss
])
def test_blocks_carrying_two_values_one_handed_on_untouched(kinds, keep, repeated):
    """The blocks hand on two values by slot (their shape and dtype): the shared blocks take the
    indices of the last block that made them, not of the block before; the loop keeping every
    block's result exports every block."""
    torch.manual_seed(0)
    model = IndexedNet(kinds, keep)
    program, batch = _imported(model)
    assert bool(program.repeated) == repeated
    if repeated:
        assert program.repeated["blocks"].exported < len(kinds)
    out = run_imported(program, batch, stack=True)
    _agrees(model, batch, out)
    from hspmd.dialects import graph

    # the layers stack (exported in part or not), a period of "fsss" (or "fs") a scan iteration:
    # the shared blocks take the indices of the period's "f" block, inside the period's function;
    # where the loss reads every block's result, they stay calls
    scans = [o for o in program.module.walk() if isinstance(o, graph.ScanOp) and not o.is_reverse]
    periods = [s for s in scans if "period" in s.callee.root_reference.data]
    assert bool(periods) == (not keep) and all(s.num_iterations >= 2 for s in periods)


class Offset(Block):
    """A block adding a tensor it holds as a plain attribute (no buffer: `block_key` does not see
    it) of a value of its own, or scaling by a float made from its number: what the eager
    comparison must see."""

    def __init__(self, kind: str, i: int, how: str) -> None:
        super().__init__(kind, i, False)
        self.offset = torch.full((8,), 0.5 if how != "tensor" else 0.1 * i)
        self.how = how

    def forward(self, x, bias):
        scale = 1.0 + self.layer_idx / 10 if self.how == "float" else 1.0
        return Block.forward(self, x, bias) * scale + self.offset


@pytest.mark.parametrize("how,alike", [("same", True), ("tensor", False), ("float", False)])
def test_two_blocks_are_compared_eagerly_where_the_first_blocks_kind_does_not_repeat(how, alike):
    """A first block of its own (a dense layer): the export keeps the first of the other kind
    only, and the importer compares it with the next of its kind by what they compute eagerly
    (`eager_signatures`: ops, arguments, where each tensor comes from)."""
    from hspmd.frontend.torch_layer_values import eager_signatures

    torch.manual_seed(0)
    model = Net("c")
    model.blocks.extend(Offset("b", i, how) for i in range(1, 6))
    pattern = pattern_of("cbbbbb")
    assert pattern.eager_checked == (1, 2) and pattern.blocks == (0, 1)
    batch = {"x": torch.randn(4, 8)}
    first, second = eager_signatures(model, lambda: model(batch), model.blocks, (1, 2))
    assert (first == second) == alike and len(first) > 5
    program, batch = _imported(model)
    assert (program.repeated == {"blocks": pattern}) == alike
    _agrees(model, batch, run_imported(program, batch, stack=True))


class Skip(Block):
    def forward(self, x, older):
        return x + torch.tanh(self.fc(x)) * 0.5 + older * 0.25


class SkipNet(Net):
    """Blocks each reading the results of the two blocks before it (a skip over one layer): no
    scan hands a value on two iterations, so the calls stay calls, with PyTorch's numbers."""

    def __init__(self) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList(Skip("a", i, False) for i in range(6))

    def forward(self, batch):
        x, older = batch["x"] + self.bias, batch["x"] * 0.0
        for block in self.blocks:
            x, older = block(x, older), x
        return (x ** 2).mean()


def test_blocks_reading_two_blocks_back_stay_calls():
    torch.manual_seed(0)
    model = SkipNet()
    program, batch = _imported(model)
    assert program.repeated == {}  # two values of one shape and dtype handed on
    out = run_imported(program, batch, stack=True)
    from hspmd.dialects import graph

    assert not [o for o in program.module.walk() if isinstance(o, graph.ScanOp)]
    _agrees(model, batch, out)


class Fed(Block):
    def forward(self, x, bias, mine):
        return Block.forward(self, x, bias) + torch.tanh(mine)


class FedNet(Net):
    """Blocks each handed a slice of their own of one tensor (Gemma-4's per-layer inputs): a
    block left out takes its own slice, not its template's (which it took, silently, before)."""

    def __init__(self, kinds: str) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList(Fed(k, i, False) for i, k in enumerate(kinds))
        self.per_layer = torch.nn.Linear(8, 8 * len(kinds))

    def forward(self, batch):
        x, bias = batch["x"], self.bias * 2
        mine = self.per_layer(x).reshape(x.shape[0], len(self.blocks), 8)
        for i, block in enumerate(self.blocks):
            x = block(x, bias, mine[:, i, :])
        return (x ** 2).mean()


@pytest.mark.parametrize("kinds", ["aaaaaa", "cbbbbbb", "ppqppqp"])
def test_blocks_handed_tensors_of_their_own_take_theirs(kinds):
    torch.manual_seed(0)
    model = FedNet(kinds)
    program, batch = _imported(model)
    assert program.repeated == {"blocks": pattern_of(kinds)}
    _agrees(model, batch, run_imported(program, batch, stack=True))
