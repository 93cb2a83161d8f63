"""Strategy text (lark grammar, DESIGN.md section 3): how a run spreads over devices.

    [0-3]: dp=1 tp=2 pp=2 share=2 | [4,5]: dp=1 tp=2 pp=1 share=1

One entry per device group: data-parallel (`dp`), tensor-parallel (`tp`), pipeline (`pp`)
and expert-parallel (`ep`: a mixture of experts' weights split along the expert dim over ep
ranks, which also split the batch, as dp ranks do; see docs/moe.md) degrees, `experts=N` for
how many of a mixture's experts the group holds when groups hold different numbers
(`[0,1]: ep=2 experts=6 | [2]: ep=1 experts=2`; every group then says it, and ep divides it), the group's batch `share` and its ZeRO stage `zero` (0, 1, 2 or 3: 1 and 2 shard the
optimizer states over dp, see the `shard-optimizer-state` pass, 3 the parameters too, see
`shard-parameters`; default 0), activation recompute `recompute=none|block|selective` (see the
`recompute` pass; default none), `sp=1` for
sequence parallelism (Megatron-style, over the tp ranks; needs tp > 1; default 0) and
`layers=A:B:...` for the number of layers each pipeline stage takes (one count per stage, pp of
them; default: contiguous ranges balanced by cost). How the data-parallel ranks communicate
(docs/parameter-server.md): `comm=allreduce|ps|hybrid` (default allreduce), the consistency
model `consistency=bsp|asp|ssp:S` (default bsp; asp and ssp need ps or hybrid) and the HET
cache `cache=ROWS` or `cache=ROWS:B` (hot embedding rows each worker keeps, each used for at most
B steps after it was pulled; B defaults to S of ssp:S, and bsp means 0; default 0, no cache), and
`device=cuda|cpu` for the kind of device the group's ranks run on (GPU and CPU ranks in one job:
`[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu share=1`; default: what `hspmd run
--device` says; it changes no IR, only which program each rank runs, see docs/gpu.md). Keys come in any order, separated by spaces or commas,
and each defaults to 1; dp*tp*pp*ep must equal the number of devices in the group, except that a
group giving none of dp/tp/pp/ep is pure data parallel (`[0-3]:` means dp=4). Syntax errors and
unknown keys raise `StrategyError` with a caret under the offending column; impossible
strategies raise it with one sentence. Printing is canonical: dp always, the other keys
when they are not their default (1; `zero` 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lark import Lark, Token
from lark.exceptions import UnexpectedInput

from hspmd.ir.devices import DeviceRange, DeviceSetError, concat
from hspmd.ir.layout import apportion, format_devices
from hspmd.ir.layout_text import DEVLIST_GRAMMAR, terminal_words, caret_message, devices_of, syntax_error

__all__ = ["StrategyError", "StrategyGroup", "Strategy", "StrategyRecord", "parse_strategy", "PIPELINE_SCHEDULES"]

_KEYS = ("dp", "tp", "pp", "share", "zero", "sp", "layers", "ep", "experts", "comm", "consistency", "cache",
         "recompute", "device")
_DEFAULTS = {"zero": 0, "sp": 0, "layers": None, "experts": None, "comm": "allreduce", "consistency": "bsp",
             "cache": 0, "recompute": "none", "device": None}
#: the order keys print in (`dp=1 device=cuda share=3`: where a group runs, then how much it takes)
_PRINT_ORDER = ("dp", "tp", "pp", "device", "share", "zero", "sp", "layers", "ep", "experts", "comm",
                "consistency", "cache", "recompute")
#: the keys in words, as errors list them
_KEYS_TEXT = ", ".join(_KEYS[:-1]) + " or " + _KEYS[-1]
#: how a group's data-parallel ranks exchange gradients: collectives, parameter servers, or both
#: (embedding tables through the servers, dense parameters by all-reduce)
COMM_MODES = ("allreduce", "ps", "hybrid")
#: the consistency models of a parameter-server run (`ssp` takes its bound: `ssp:2`)
CONSISTENCY_MODELS = ("bsp", "asp", "ssp")
_WORD_KEYS = ("comm", "consistency", "recompute", "device")
#: the kinds of device a group may name (`device=cuda`); a group naming none runs where `hspmd run
#: --device` says
DEVICE_KINDS = ("cpu", "cuda")
ZERO_STAGES = (0, 1, 2, 3)
#: activation recompute per group (`transforms/recompute.py`): none, each repeated block's forward
#: again inside its backward, or only attention's scores, softmax and dropout (Megatron's selective)
RECOMPUTE_MODES = ("none", "block", "selective")
#: the pipeline schedules a strategy may name (`hspmd.ir.pipeline_schedule.SCHEDULES` runs them)
PIPELINE_SCHEDULES = ("gpipe", "1f1b")

_GRAMMAR = r"""
strategy: sgroup ("|" sgroup)*
sgroup: devset ":" (kv (","? kv)*)?
kv: NAME "=" (INT | NAME) (":" INT)*
NAME: /[A-Za-z_][A-Za-z_0-9]*/
""" + DEVLIST_GRAMMAR

_PARSER = Lark(_GRAMMAR, start="strategy", parser="lalr", maybe_placeholders=False)
_WORDS = terminal_words(_PARSER, {"INT": "a number", "NAME": f"a key ({_KEYS_TEXT})",
                                   "$END": "end of text"})


class StrategyError(ValueError):
    """A bad strategy. For syntax errors `text`, `line`, `column` and `expected` say where; else they are None."""

    def __init__(self, message: str, text: str | None = None, line: int | None = None,
                 column: int | None = None, expected: str | None = None):
        self.message, self.text, self.line, self.column, self.expected = message, text, line, column, expected
        if text is None or line is None or column is None:
            super().__init__(message)
        else:
            super().__init__(caret_message(message, text, line, column, expected))


def _describe(devices) -> str:
    """Return a short description of a device set: `0-3` when contiguous, else the sorted list."""
    if isinstance(devices, DeviceRange):
        devices = devices.sorted()
        if devices.ids is None and devices.strides in ((), (1,)):
            return f"{devices.min}-{devices.max}" if len(devices) > 1 else str(devices.min)
        return str(devices)
    s = sorted(devices)
    if s and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0])
    return format_devices(s)


def _value_text(value) -> str:
    return ":".join(map(str, value)) if isinstance(value, tuple) else str(value)


@dataclass(frozen=True)
class StrategyGroup:
    """One device group of a strategy: its devices, dp/tp/pp degrees, batch share and ZeRO stage.

    >>> str(StrategyGroup((0, 1, 2, 3), tp=2, pp=2, share=2)), str(StrategyGroup((4, 5), dp=2, zero=1))
    ('[0-3]: dp=1 tp=2 pp=2 share=2', '[4,5]: dp=2 zero=1')
    """

    devices: DeviceRange
    dp: int = 1
    tp: int = 1
    pp: int = 1
    share: int = 1
    zero: int = 0
    sp: int = 0
    layers: tuple[int, ...] | None = None
    ep: int = 1
    experts: int | None = None
    comm: str = "allreduce"
    consistency: str = "bsp"
    cache: int | tuple[int, int] = 0
    recompute: str = "none"
    device: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.devices, DeviceRange):
            try:
                object.__setattr__(self, "devices", DeviceRange.of(self.devices))
            except DeviceSetError:
                ids = tuple(self.devices)
                raise StrategyError(f"group '[{format_devices(ids)}]: ...' needs distinct device ids >= 0") from None
        text = str(self)
        self._check_communication(text)
        for key in (*_KEYS[:4], "ep"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise StrategyError(f"group '{text}' has {key}={v!r}; dp, tp, pp, ep and share must be integers >= 1")
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in ZERO_STAGES:
            raise StrategyError(f"group '{text}' has zero={self.zero!r}; zero must be 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE_MODES:
            raise StrategyError(f"group '{text}' has recompute={self.recompute!r}; recompute must be one of "
                                f"{', '.join(RECOMPUTE_MODES)}")
        if self.device is not None and self.device not in DEVICE_KINDS:
            raise StrategyError(f"group '{text}' has device={self.device!r}; device must be one of "
                                f"{', '.join(DEVICE_KINDS)}")
        if isinstance(self.sp, bool) or self.sp not in (0, 1):
            raise StrategyError(f"group '{text}' has sp={self.sp!r}; sp must be 0 or 1")
        if self.zero and self.ep > 1 and self.pp > 1:
            raise StrategyError(f"group '{text}' asks for ZeRO (zero={self.zero}) with expert parallelism "
                                f"(ep={self.ep}) in a pipeline (pp={self.pp}), which is not supported yet; "
                                "use zero with ep and pp=1, or zero=0 with ep and pp")
        if self.sp and self.tp == 1:
            raise StrategyError(f"group '{text}' asks for sequence parallelism (sp=1) with tp=1; "
                                "sequence parallelism splits the sequence over the tp ranks, so it needs tp > 1")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
            if len(self.layers) != self.pp or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                   for n in self.layers):
                raise StrategyError(f"group '{text}' gives layers={':'.join(map(str, self.layers))} for pp={self.pp}; "
                                    "layers needs one count >= 1 per pipeline stage")
        if self.experts is not None and (isinstance(self.experts, bool) or not isinstance(self.experts, int)
                                         or self.experts < 1 or self.experts % self.ep):
            raise StrategyError(f"group '{text}' has experts={self.experts!r}; a group's experts must be an integer "
                                f">= 1 that its ep={self.ep} divides (each ep rank holds experts/ep of them)")
        n = self.dp * self.tp * self.pp * self.ep
        if n != len(self.devices):
            rest = self.tp * self.pp * self.ep
            fit = len(self.devices) // rest
            hint = f" (dp={fit} would fit)" if fit * rest == len(self.devices) else ""
            product = "dp*tp*pp" + ("*ep" if self.ep > 1 else "")
            degrees = f"{self.dp}*{self.tp}*{self.pp}" + (f"*{self.ep}" if self.ep > 1 else "")
            raise StrategyError(
                f"group '{text}' has {product} = {degrees} = {n} but {len(self.devices)} "
                f"devices; the product of {'dp, tp, pp and ep' if self.ep > 1 else 'dp, tp and pp'} must equal "
                f"the number of devices{hint}")

    @property
    def batch_ranks(self) -> int:
        """Return how many ways the group splits its batch rows: dp times ep (expert-parallel
        ranks hold different rows too, and exchange tokens only inside the experts)."""
        return self.dp * self.ep

    def _check_communication(self, text: str) -> None:
        """Raise StrategyError unless comm, consistency and cache fit together (and the group)."""
        if self.comm not in COMM_MODES:
            raise StrategyError(f"group '{text}' has comm={self.comm!r}; comm must be one of {', '.join(COMM_MODES)}")
        if self.consistency_model not in CONSISTENCY_MODELS or (
                self.consistency_model == "ssp") != (":" in str(self.consistency)):
            raise StrategyError(f"group '{text}' has consistency={self.consistency!r}; "
                                "consistency must be bsp, asp or ssp:S (S >= 0 steps)")
        if isinstance(self.cache, tuple):
            object.__setattr__(self, "cache", tuple(self.cache))
        parts = self.cache if isinstance(self.cache, tuple) else (self.cache,)
        if len(parts) > 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in parts):
            raise StrategyError(f"group '{text}' has cache={_value_text(self.cache)}; cache must be ROWS or "
                                "ROWS:B (a row count and a staleness bound in steps, both >= 0)")
        if self.comm == "allreduce" and (self.consistency != "bsp" or self.cache_rows):
            raise StrategyError(f"group '{text}' asks for consistency={self.consistency} / cache={_value_text(self.cache)} "
                                "with comm=allreduce; they need parameter servers (comm=ps or comm=hybrid)")
        if self.cache_rows and self.cache_bound is None:
            raise StrategyError(f"group '{text}' asks for cache={self.cache} under consistency=asp; give the HET "
                                "cache its staleness bound, cache=ROWS:B (under ssp:S it defaults to S)")
        if self.comm != "allreduce" and (self.tp > 1 or self.pp > 1 or self.ep > 1 or self.zero or self.sp):
            raise StrategyError(f"group '{text}' uses comm={self.comm}; parameter servers serve data "
                                "parallelism only (tp, pp, ep, zero and sp must keep their defaults)")

    @property
    def cache_rows(self) -> int:
        """Return the HET cache's rows per worker and table (0: no cache)."""
        return self.cache[0] if isinstance(self.cache, tuple) else self.cache

    @property
    def cache_bound(self) -> int | None:
        """Return the steps a cached row is used after its pull: B of cache=ROWS:B, else the
        consistency's bound (None under asp)."""
        return self.cache[1] if isinstance(self.cache, tuple) else self.staleness_bound

    @property
    def consistency_model(self) -> str:
        """Return the consistency model without its bound: "bsp", "asp" or "ssp"."""
        return str(self.consistency).split(":")[0]

    @property
    def staleness_bound(self) -> int | None:
        """Return how many steps a worker may run ahead of the slowest: 0 under bsp, S under ssp:S,
        None (no bound) under asp."""
        model = self.consistency_model
        return 0 if model == "bsp" else None if model == "asp" else int(str(self.consistency).split(":")[1])

    def __str__(self) -> str:
        keys = " ".join(f"{k}={_value_text(getattr(self, k))}" for k in _PRINT_ORDER
                        if k == "dp" or getattr(self, k) != _DEFAULTS.get(k, 1))
        return f"{self.devices.bracketed()}: {keys}"


@dataclass(frozen=True)
class Strategy:
    """A whole strategy: one StrategyGroup per device group, on disjoint devices.

    >>> s = parse_strategy("[0-3]: tp=2, pp=2 share=2 | [4,5]: tp=2")
    >>> str(s)
    '[0-3]: dp=1 tp=2 pp=2 share=2 | [4,5]: dp=1 tp=2'
    >>> s.num_devices
    6
    """

    groups: tuple[StrategyGroup, ...]

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups:
            raise StrategyError("a strategy needs at least one group")
        for i, g in enumerate(groups):  # pairwise, O(1) for two ranges
            for h in groups[:i]:
                if not h.devices.isdisjoint(g.devices):
                    both = set(h.devices) & set(g.devices)
                    raise StrategyError(f"strategy '{self}' puts device {min(both)} in more than one group")
        given = [g.experts is not None for g in groups]
        if any(given) and not all(given):
            raise StrategyError(f"strategy '{self}' gives experts= for some groups only; give every group its "
                                "number of experts (they add up to the model's experts) or none")

    @property
    def expert_shares(self) -> tuple[int, ...] | None:
        """Return each group's number of experts where the strategy places them unevenly, else None."""
        counts = tuple(g.experts for g in self.groups)
        return None if None in counts else counts  # type: ignore[return-value]

    def __str__(self) -> str:
        return " | ".join(str(g) for g in self.groups)

    @property
    def devices(self) -> DeviceRange:
        """Return all devices, group by group (a range where they form one)."""
        return concat([g.devices for g in self.groups])

    @property
    def num_devices(self) -> int:
        """Return the number of devices the strategy uses."""
        return sum(len(g.devices) for g in self.groups)

    def check_devices(self, n: int) -> None:
        """Return None if the strategy uses exactly devices 0..n-1; else raise StrategyError."""
        devs = self.devices
        if devs.same_set(DeviceRange.iota(n)):
            return
        count = f"{len(devs)} device{'s' if len(devs) != 1 else ''}"
        if devs.same_set(DeviceRange.iota(len(devs))):
            raise StrategyError(f"strategy '{self}' uses {count} ({_describe(devs)}) but the run has -n {n}")
        raise StrategyError(f"strategy '{self}' uses devices {_describe(devs)} but the run has -n {n}, "
                            f"which needs devices {_describe(tuple(range(n)))} exactly")


def _err(text: str, tok: Token, message: str, expected: str | None = None) -> StrategyError:
    return StrategyError(f"bad strategy at line {tok.line}, column {tok.column}: {message}",
                         text, tok.line, tok.column, expected)


def parse_strategy(text: str) -> Strategy:
    """Return the Strategy that `text` describes.

    >>> str(parse_strategy("[0,1]: dp=2, share=1"))
    '[0,1]: dp=2'
    """
    if not isinstance(text, str):
        raise TypeError(f"strategy text must be a str, got {type(text).__name__}")
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as err:
        raise syntax_error(err, text, "strategy", _WORDS, StrategyError) from None
    groups = []
    for sg in tree.children:
        devset, *kvs = sg.children
        devices = devices_of(devset, text, _err)
        values: dict[str, int | tuple[int, ...]] = {}
        for kv in kvs:
            key, value, *more = kv.children
            if key not in _KEYS:
                raise _err(text, key, f"unknown key '{key}'", _KEYS_TEXT)
            if key in values:
                raise _err(text, key, f"key '{key}' is given twice")
            if key in _WORD_KEYS or value.type == "NAME":
                values[str(key)] = _word_value(text, key, value, more)
                continue
            if key == "cache" and more:
                if len(more) > 1:
                    raise _err(text, more[1], "cache takes ROWS or ROWS:B", "end of the key")
                values["cache"] = (int(value), int(more[0]))
                continue
            if more and key != "layers":
                raise _err(text, more[0], f"key '{key}' takes one number, not a list", "a number")
            if key == "layers":
                counts = (value, *more)
                bad = [c for c in counts if int(c) < 1]
                if bad:
                    raise _err(text, bad[0], f"a stage needs at least one layer, not {bad[0]}", "a number >= 1")
                values["layers"] = tuple(int(c) for c in counts)
                continue
            if key == "sp":
                if int(value) not in (0, 1):
                    raise _err(text, value, f"sp={value} is not 0 or 1", "0 or 1")
            elif key == "zero":
                if int(value) not in ZERO_STAGES:
                    raise _err(text, value, f"zero={value} is not a supported ZeRO stage", "0, 1, 2 or 3")
            elif int(value) < 1:
                raise _err(text, value, f"{key}={value} must be >= 1", "a number >= 1")
            values[str(key)] = int(value)
        if "layers" in values and "pp" not in values:
            values["pp"] = len(values["layers"])  # type: ignore[arg-type]
        if not {"dp", "tp", "pp", "ep"} & values.keys():
            values["dp"] = len(devices)
        groups.append(StrategyGroup(devices, **values))
    return Strategy(tuple(groups))


def _word_value(text: str, key: Token, value: Token, more: list[Token]) -> str:
    """Return the value of a key that takes a word (`comm=ps`, `consistency=ssp:2`), checked."""
    if key not in _WORD_KEYS:
        raise _err(text, value, f"key '{key}' takes a number, not '{value}'", "a number")
    if value.type != "NAME":
        words = {"comm": COMM_MODES, "recompute": RECOMPUTE_MODES, "device": DEVICE_KINDS}
        raise _err(text, value, f"key '{key}' takes a word, not {value}",
                   ", ".join(words[key]) if key in words else "bsp, asp or ssp:S")
    if key == "device":
        if value not in DEVICE_KINDS or more:
            raise _err(text, value, f"device={value}{':' if more else ''} is not a kind of device", ", ".join(DEVICE_KINDS))
        return str(value)
    if key == "recompute":
        if value not in RECOMPUTE_MODES or more:
            raise _err(text, value, f"recompute={value}{':' if more else ''} is not a recompute mode", ", ".join(RECOMPUTE_MODES))
        return str(value)
    if key == "comm":
        if value not in COMM_MODES or more:
            raise _err(text, value, f"comm={value}{':' if more else ''} is not a communication mode", ", ".join(COMM_MODES))
        return str(value)
    if value not in CONSISTENCY_MODELS:
        raise _err(text, value, f"consistency={value} is not a consistency model", "bsp, asp or ssp:S")
    if (value == "ssp") != (len(more) == 1) or len(more) > 1:
        raise _err(text, value, "ssp takes its staleness bound (ssp:S) and bsp/asp take none", "bsp, asp or ssp:S")
    return f"ssp:{int(more[0])}" if more else str(value)


@dataclass(frozen=True)
class StrategyRecord:
    """A strategy as a module records it (`#dist.strategy`): its id, the strategy, and how its
    pipelines run (micro-batches per step, schedule).

    A module may carry several records, one per id, so that one program can hold the steps of
    several strategies (graph switching); passes read the record, never strategy text.

    >>> StrategyRecord(0, parse_strategy("[0-3]: tp=2 pp=2"), microbatches=4, schedule="1f1b").pipelined
    True
    """

    id: int
    strategy: Strategy
    microbatches: int = 1
    schedule: str = "gpipe"

    def __post_init__(self) -> None:
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 0:
            raise StrategyError(f"a strategy's id must be an integer >= 0, not {self.id!r}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise StrategyError(f"microbatches={self.microbatches!r}: the number of micro-batches must be >= 1")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise StrategyError(f"unknown schedule '{self.schedule}' (known: {', '.join(PIPELINE_SCHEDULES)})")

    @property
    def pipelined(self) -> bool:
        """Return whether some group of the strategy has pp > 1."""
        return any(g.pp > 1 for g in self.strategy.groups)


def even_out_rows(strategy: Strategy, rows: int) -> Strategy:
    """Return `strategy` with every group whose rows its dp does not divide cut in two even ones.

    A group's rows are its share of the batch's `rows` (`apportion`); within a group they are
    split equally over dp. Where dp does not divide them (`dp=3` over 16 rows, a 9-row share
    over `dp=2`), the first r dp ranks (r the remainder) take one row more than the others: the
    group becomes two groups of the same tp and ZeRO stage, `dp=r` with q+1 rows per rank and
    `dp=d-r` with q, their shares the rows themselves, which the layouts then hold exactly
    (HetSeq's per-GPU row counts). Every group of the result splits its rows evenly; the
    training math is unchanged (the loss weights each row by 1/B whoever holds it).

    Groups with a pipeline, with fewer rows than dp ranks, or whose rows divide are left as they
    are (the compiler's checks speak for them); a strategy with nothing to even is returned as is.

    >>> str(even_out_rows(parse_strategy("[0-2]: dp=3"), 16))
    '[0]: dp=1 share=3 | [1,2]: dp=2 share=5'
    >>> str(even_out_rows(parse_strategy("[0-3]: dp=2 tp=2 share=9 | [4,5]: tp=2 share=7"), 16))
    '[0,1]: dp=1 tp=2 share=5 | [2,3]: dp=1 tp=2 share=4 | [4,5]: dp=1 tp=2 share=7'
    """
    groups = strategy.groups
    counts = apportion(rows, tuple(g.share for g in groups)) if len(groups) > 1 else (rows,)
    out: list[tuple[StrategyGroup, int]] = []
    for g, r in zip(groups, counts):
        if g.pp > 1 or g.ep > 1 or g.experts is not None or r < g.dp or r % g.dp == 0:
            out.append((g, r))
            continue
        q, rem = divmod(r, g.dp)
        cut = rem * g.tp  # devices are dp-major, tp-minor: dp rank i holds devices[i*tp:(i+1)*tp]
        for devices, dp, per in ((g.devices[:cut], rem, q + 1), (g.devices[cut:], g.dp - rem, q)):
            out.append((replace(g, devices=devices, dp=dp, zero=g.zero if dp > 1 else 0), dp * per))
    if len(out) == len(groups):
        return strategy
    common = math.gcd(*(r for _, r in out))
    return Strategy(tuple(replace(g, share=r // common) for g, r in out))
