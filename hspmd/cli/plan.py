"""`hspmd plan SCRIPT -n N [--profile P] [--memory-per-rank 2GiB] [--top 5]` and `--strategy auto`.

Prints the model facts the planner read, the top candidates as a table (strategy, settings,
predicted step time and memory per rank, what the time is made of, and why each lost to the
first), and last the chosen strategy alone on one line, as `--strategy` takes it. The choice
is the fastest candidate that fits the memory limit and compiles; the compile is checked
before it is printed.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports the compiler only when a command needs it
    from hspmd.compiler import Compiled
    from hspmd.planner import Candidate, Machine, ModelFacts

__all__ = ["add_plan_parser", "auto_strategy", "choose_strategy", "cmd_plan", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """Return the bytes of a size such as `2GiB`, `512MiB`, `1.5e9` (SystemExit when it is not one)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise SystemExit(f"hspmd: error: --memory-per-rank {text!r}: expected a size such as 2GiB, 512MiB or 1e9")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def add_plan_parser(sub) -> None:
    """Add the `plan` subcommand to `hspmd`'s subparsers."""
    p = sub.add_parser("plan", help="pick a strategy for a script on N devices (docs/planning.md)")
    p.add_argument("script")
    p.add_argument("-n", type=int, required=True, help="number of devices")
    p.add_argument("--profile", metavar="P", help="a device profile from 'hspmd profile' (default: all ranks alike)")
    p.add_argument("--memory-per-rank", metavar="SIZE", help="drop candidates that need more, e.g. 2GiB")
    p.add_argument("--top", type=int, default=5, help="candidates to show (default 5)")
    p.add_argument("--redundancy", metavar="peer[:K]",
                   help="count the host memory of in-memory peer copies (hspmd run --elastic --redundancy peer)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an entry of the script's config")
    from hspmd.cli.pass_flags import add_pass_arguments

    add_pass_arguments(p, watch=False)
    p.set_defaults(func=cmd_plan)


def load_machine(profile: str | None, n: int):
    """Return the planner's Machine: from the profile file, or every rank alike."""
    from hspmd.planner import Machine

    if profile is None:
        return Machine.uniform(n)
    import socket

    from hspmd.ir.device_profile import DeviceProfile

    loaded = DeviceProfile.load_for(profile, n)
    hosts = set(loaded.meta.get("hosts") or [])
    if hosts and socket.gethostname() not in hosts:
        print(f"note: {profile} was measured on {', '.join(sorted(hosts))}, not on this host "
              f"({socket.gethostname()}): the plan assumes those devices")
    return Machine(loaded)


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def _why(c, best) -> str:
    """Return what makes candidate `c` slower than `best` (its largest excess)."""
    if c is best:
        return "fastest"
    mine, theirs = c.parts(), best.parts()
    name, excess = max(((k, mine[k] - theirs[k]) for k in mine), key=lambda kv: kv[1])
    return f"+{(c.step_s / best.step_s - 1) * 100:.0f}%: {name} +{excess * 1e3:.1f} ms"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def _compile(script, candidate, n: int, passes=None):
    """Return ((the candidate compiled, the ranks it works on), None), or (None, the compiler's
    message) when it does not compile (a candidate leaving ranks idle compiles for the others)."""
    from hspmd.compiler import InternalError
    from hspmd.compiler import compile_working
    from hspmd.dialects.sharding import ShardingError
    from hspmd.ir.layout import LayoutError
    from hspmd.ir.strategy import StrategyError
    from hspmd.transforms.util import PassError

    try:
        return compile_working(script, candidate.strategy(), n, microbatches=candidate.microbatches,
                               pipeline_schedule=candidate.schedule, passes=passes), None
    except (PassError, StrategyError, ShardingError, LayoutError) as err:
        return None, str(err).splitlines()[0]
    except InternalError as err:  # a compiler bug on this candidate: said as such, the search goes on
        return None, f"{err} (IR in {err.ir_path}; please report it)"


@dataclass(frozen=True)
class Choice:
    """What the planner chose and what it weighed."""

    chosen: Candidate
    compiled: Compiled  # the chosen strategy, compiled (checked before it is chosen)
    ranks: tuple[int, ...]  # the ranks it works on (the others idle: hspmd.runtime.launcher.idle)
    fits: list[Candidate]  # every candidate under the memory limit, best first
    over: list[Candidate]  # those over it
    facts: ModelFacts
    machine: Machine
    read_s: float  # reading the facts (the probe compiles)
    search_s: float


def choose_strategy(script, n: int, profile: str | None = None, memory: float | None = None,
                    report=None, passes=None, redundancy: bool = False) -> Choice:
    """Return the planner's choice for `script` on `n` devices: the fastest candidate under
    `memory` that compiles (with the user's passes of `passes`, a `PassManager`, where given).
    `report(line)` hears about candidates that do not compile."""
    from hspmd.planner import PlanError, model_facts, plan

    machine = load_machine(profile, n)
    start = time.perf_counter()
    facts = model_facts(script, n)
    read = time.perf_counter() - start
    start = time.perf_counter()
    fits, over = plan(facts, machine, memory, redundancy)
    searched = time.perf_counter() - start
    if not fits:
        lean = min(over, key=lambda c: c.memory_bytes)
        raise PlanError(f"no strategy fits --memory-per-rank {_mib(memory or 0)}: the leanest of {len(over)} "
                        f"candidates, '{lean.strategy()}'{' with ' + ' '.join(lean.settings()) if lean.settings() else ''}"
                        f", needs {_mib(lean.memory_bytes)} per rank (more devices, ZeRO or a smaller batch need less)")
    for c in fits[:8]:
        done, problem = _compile(script, c, n, passes)
        if done is not None:
            return Choice(c, *done, fits, over, facts, machine, read, searched)
        if report:
            report(f"  {c.strategy()} does not compile ({problem}); next")
    raise PlanError("none of the best candidates compiles; see the messages above")


def cmd_plan(args) -> int:
    from hspmd.frontend.script import load_script, parse_overrides

    if args.top < 1:
        raise SystemExit("hspmd: error: --top must be at least 1")
    memory = parse_bytes(args.memory_per_rank) if args.memory_per_rank else None
    script = load_script(args.script, parse_overrides(args.set))
    from hspmd.cli.pass_flags import pass_manager

    choice = choose_strategy(script, args.n, args.profile, memory, print, pass_manager(args), _redundancy(args))
    redundancy = bool(getattr(args, "redundancy", None))
    chosen, fits, over, facts, machine = choice.chosen, choice.fits, choice.over, choice.facts, choice.machine
    read, searched = choice.read_s, choice.search_s
    where = (f"profile {args.profile}" + ("" if machine.measured else ", synthetic") if args.profile
             else "no profile: every rank assumed alike (hspmd profile measures them)")
    print(f"planning {args.script} for {args.n} devices ({where})")
    print(f"model: {facts.rows} rows per step, {facts.layers} layer{'s' if facts.layers != 1 else ''}, "
          f"{facts.matmul_flops / 1e9:.2f} GFLOP of matmuls, {_mib(facts.param_bytes)} of parameters "
          f"+ {_mib(facts.state_bytes)} of optimizer states, tp up to {max(facts.tp_degrees)}, up to {facts.max_pp} "
          f"stages; read in {read:.1f} s, {len(fits) + len(over)} candidates searched in {searched:.2f} s")
    shown = ([chosen] + [c for c in fits if c is not chosen])[: args.top]
    shown_over = over[: max(0, args.top - len(shown))]
    idle = any(c.idle_ranks for c in shown + shown_over)  # a column saying which ranks a candidate leaves idle
    copies = (["copies/rank"] if redundancy else [])
    rows = [["#", "strategy", "settings", *(["idle"] if idle else []), "step ms", "memory/rank", *copies, "compute",
             "bubble", "tp", "pp", "dp", "why not"]]
    for i, c in enumerate(shown, 1):
        p = c.parts()
        rows.append([str(i), c.strategy(), " ".join(c.settings()) or "-", *([_idle(c, machine)] if idle else []),
                     f"{c.step_s * 1e3:.1f}", _mib(c.memory_bytes), *([_mib(c.copies_bytes)] if redundancy else []),
                     f"{p['compute'] * 1e3:.1f}", f"{p['pipeline bubble'] * 1e3:.1f}", f"{p['tp collectives'] * 1e3:.1f}",
                     f"{p['pipeline sends'] * 1e3:.1f}",
                     f"{(p['dp gradient sync'] + p['gradient sum across groups']) * 1e3:.1f}", _why(c, chosen)])
    for c in shown_over:
        rows.append(["-", c.strategy(), " ".join(c.settings()) or "-", *([_idle(c, machine)] if idle else []),
                     f"{c.step_s * 1e3:.1f}", _mib(c.memory_bytes), *([_mib(c.copies_bytes)] if redundancy else []),
                     "", "", "", "", "",
                     f"over --memory-per-rank {_mib(memory or 0)}"])
    print(_table(rows))
    if redundancy:
        print(f"peer copies (--redundancy peer): {_mib(chosen.copies_bytes)} of host memory per rank for the chosen "
              f"strategy (two copies of what a rank keeps, two of its buddy's unreplicated pieces), counted in "
              f"memory/rank on CPU ranks")
    for line in idle_lines(chosen, fits, machine):
        print(line)
    made = what_made_it_fit(chosen, fits + over, memory)
    if made:
        print(made)
    if chosen.settings():
        print("run it with: " + " ".join(f"--set {s}" for s in chosen.settings()))
    print("strategy:")
    print(chosen.strategy())
    return 0


def _redundancy(args) -> bool:
    """Return whether `hspmd plan --redundancy` asks for the peer copies (SystemExit for a bad spelling)."""
    text = getattr(args, "redundancy", None)
    if text is None:
        return False
    kind, sep, every = text.partition(":")
    if kind != "peer" or (sep and (not every.isdigit() or int(every) < 1)):
        raise SystemExit(f"hspmd: error: --redundancy {text}: expected peer or peer:K (K >= 1)")
    return True


def _idle(c: Candidate, machine: Machine) -> str:
    """Return the plan table's idle cell of `c`: its idle ranks with their kinds, or "-"."""
    return ",".join(f"{r} ({machine.kinds[r]})" for r in c.idle_ranks) or "-"


def idle_lines(chosen: Candidate, candidates: list[Candidate], machine: Machine) -> list[str]:
    """Return a line per rank the chosen strategy leaves idle, saying so and what the fastest
    candidate with every rank at work would take (empty where every rank works)."""
    if not chosen.idle_ranks:
        return []
    busy = min((c for c in candidates if not c.idle_ranks), key=lambda c: c.step_s, default=None)
    than = (f" (with every rank: '{busy.strategy()}' {busy.step_s * 1e3:.1f} ms per step, "
            f"+{(busy.step_s / chosen.step_s - 1) * 100:.0f}%)") if busy is not None else ""
    return [f"rank {r} ({machine.kinds[r]}): idle - the step is faster without it{than}"
            for r in chosen.idle_ranks]


def what_made_it_fit(chosen: Candidate, candidates: list[Candidate], memory: float | None) -> str | None:
    """Return a line saying which of the chosen strategy's zero=3 and recompute made it fit under
    `memory` (its twins without them, priced, are over the limit), or None when neither did."""
    from dataclasses import replace

    if memory is None:
        return None
    by_text = {(c.strategy(), c.microbatches): c for c in candidates}
    strip = {"zero=3": lambda g: replace(g, zero=0) if g.zero == 3 else g,
             "recompute": lambda g: replace(g, recompute="none")}
    used = [k for k, f in strip.items() if any(f(g) != g for g in chosen.groups)]
    if not used:
        return None
    lines = []
    for key in used:
        twin = by_text.get((replace(chosen, groups=tuple(strip[key](g) for g in chosen.groups)).strategy(),
                            chosen.microbatches))
        if twin is not None and twin.memory_bytes > memory:
            mib = lambda b: f"{b / 2**20:,.3f} MiB"  # noqa: E731 (the twins may differ in the last digits)
            lines.append(f"{key} made it fit: without it '{twin.strategy()}' needs {mib(twin.memory_bytes)} per rank, "
                         f"over --memory-per-rank {mib(memory)} (with it {mib(chosen.memory_bytes)})")
    return "\n".join(lines) or None


def auto_strategy(args, script, n: int, passes=None) -> tuple[Compiled, tuple[int, ...]]:
    """Return the program `--strategy auto` runs (planned, compiled with `passes`, a `PassManager`,
    where given) and the ranks it works on (the others stay idle), the choice said in one line."""
    choice = choose_strategy(script, n, getattr(args, "profile", None), passes=passes,
                             redundancy=bool(getattr(args, "redundancy", None)))
    chosen = choice.chosen
    settings = f" with {' '.join('--set ' + s for s in chosen.settings())}" if chosen.settings() else ""
    idle = chosen.idle_ranks
    left = (f"; rank{'s' if len(idle) > 1 else ''} {','.join(map(str, idle))} idle: the step is faster without "
            f"{'them' if len(idle) > 1 else 'it'}") if idle else ""
    print(f"hspmd run: --strategy auto chose '{chosen.strategy()}'{settings} (predicted "
          f"{chosen.step_s * 1e3:.1f} ms per step{left}; 'hspmd plan' shows the others)", flush=True)
    return choice.compiled, choice.ranks
