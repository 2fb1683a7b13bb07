"""Run graph passes in a constrained order until the graph stops changing.

Mirrors ``torch.fx.passes.infra.pass_manager.PassManager`` (ordering constraints, ``steps``,
checks after each pass) with two differences that make failures safe to recover from:

* the passes run on a deep copy of the caller's GraphModule unless ``inplace=True``, so a pass
  that raises halfway never leaves the caller's module half-transformed (reliability row 20);
  the copy costs about as much as one ``recompile`` (see ``bench/bench_partition.py``);
* every failure is a :class:`~qplug_core.errors.PassError` naming the pass and the passes that
  completed before it, chained to the original exception.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, Callable, Iterable, Sequence

from torch.fx import GraphModule

from qplug_core.errors import PassError, QplugError
from qplug_core.passes.base import PassBase, PassResult

__all__ = ["PassManager", "this_before_that_pass_constraint", "pass_name", "Constraint"]

logger = logging.getLogger(__name__)

Pass = Callable[[GraphModule], Any]
Constraint = Callable[[Pass, Pass], bool]
Check = Callable[[GraphModule], Any]


def pass_name(p: Any) -> str:
    """A readable name for a pass: ``PassBase.name``, a function's name, else its class name."""
    if isinstance(p, PassBase):
        return p.name
    if inspect.isfunction(p) or inspect.ismethod(p):
        return p.__name__
    return getattr(p, "__name__", None) or type(p).__name__


def this_before_that_pass_constraint(this: Pass, that: Pass) -> Constraint:
    """A constraint saying ``this`` must run before ``that``.

    A constraint ``c(a, b)`` returns False when ``a`` may *not* be scheduled before ``b`` (torch's
    convention), so this one only rejects the pair ``(that, this)``.
    """

    def depends_on(a: Pass, b: Pass) -> bool:
        return not (a is that and b is this)

    depends_on.__name__ = f"{pass_name(this)}_before_{pass_name(that)}"
    return depends_on


def _lint(graph_module: GraphModule) -> None:
    graph_module.graph.lint()


class PassManager:
    """Order passes by constraints, run them ``steps`` times at most, check invariants.

    Args:
        passes: callables taking a GraphModule. A pass returns a :class:`PassResult`; a plain
            function may instead return a GraphModule (taken as modified) or ``None`` (it edited
            the module in place and is taken as modified, as torch's ``pass_result_wrapper``
            does). Anything else is a :class:`PassError`.
        constraints: ``c(a, b) -> bool``; False means ``a`` must not run before ``b``.
        steps: maximum rounds over the pass list; stops early after a round where no pass
            reported ``modified=True``.
        run_checks_after_each_pass: run ``graph.lint()`` and the checks from :meth:`add_checks`
            after every pass (they always run once before the first pass).
        suppress_check_failures: log a warning instead of raising when a check fails.
        inplace: run the passes on the caller's module itself (no copy; a failing pass may
            then leave it half-transformed). The default works on a deep copy.
        recompile: regenerate ``forward`` after each pass that modified the graph (the default).
            False leaves it to the caller, for a run whose graph goes straight into another run
            that recompiles (prepare's fusion stage): generating and compiling the Python of a
            5,600-node graph costs ~0.2 s, and nothing between the runs calls ``forward``.
    """

    def __init__(
        self,
        passes: Sequence[Pass] | None = None,
        constraints: Sequence[Constraint] | None = None,
        steps: int = 1,
        run_checks_after_each_pass: bool = False,
        suppress_check_failures: bool = False,
        *,
        inplace: bool = False,
        recompile: bool = True,
    ) -> None:
        if not isinstance(steps, int) or steps < 1:
            raise PassError(f"PassManager steps must be a positive int, got {steps!r}; "
                            "use steps=1 to run the pass list once.")
        self.passes: list[Pass] = list(passes or [])
        self.constraints: list[Constraint] = list(constraints or [])
        self.steps = steps
        self.run_checks_after_each_pass = run_checks_after_each_pass
        self.suppress_check_failures = suppress_check_failures
        self.inplace = inplace
        self.recompile = recompile
        self._checks: list[Check] = [_lint]
        self._validated = False

    # -- schedule ----------------------------------------------------------------------------

    def add_pass(self, p: Pass) -> None:
        """Append a pass; the order is re-solved on the next run."""
        self.passes.append(p)
        self._validated = False

    def add_constraint(self, constraint: Constraint) -> None:
        """Add an ordering constraint; the order is re-solved on the next run."""
        self.constraints.append(constraint)
        self._validated = False

    def add_checks(self, check: Check) -> None:
        """Add an invariant check ``check(graph_module)`` that raises when the graph is bad.

        Unlike torch (which keeps only the last one) every added check runs, after ``lint``.
        """
        try:
            n_params = len(inspect.signature(check).parameters)
        except (TypeError, ValueError) as e:
            raise PassError(f"check {check!r} is not an inspectable callable; pass a function "
                            "taking exactly one argument, the GraphModule.") from e
        if n_params != 1:
            raise PassError(f"check {pass_name(check)!r} takes {n_params} parameters; a check must "
                            "take exactly one, the GraphModule (def check(gm): ...).")
        self._checks.append(check)

    def validate_constraints(self) -> None:
        """Raise :class:`PassError` if the current pass order breaks a constraint."""
        for constraint in self.constraints:
            for i, a in enumerate(self.passes):
                for b in self.passes[i + 1:]:
                    if not constraint(a, b):
                        raise PassError(
                            f"pass order violates constraint {pass_name(constraint)!r}: "
                            f"{pass_name(a)!r} is scheduled before {pass_name(b)!r}; reorder the "
                            "passes or call solve_constraints().", pass_name=pass_name(a))
        self._validated = True

    def solve_constraints(self) -> None:
        """Reorder the passes topologically; keep the given order where constraints allow."""
        n = len(self.passes)
        # before[j] holds the passes that must run before pass j.
        before: list[set[int]] = [set() for _ in range(n)]
        for constraint in self.constraints:
            for i in range(n):
                for j in range(n):
                    if i != j and not constraint(self.passes[i], self.passes[j]):
                        before[i].add(j)
        order: list[int] = []
        done: set[int] = set()
        while len(order) < n:
            ready = [i for i in range(n) if i not in done and before[i] <= done]
            if not ready:
                raise PassError(self._cycle_message(before, done))
            order.append(ready[0])
            done.add(ready[0])
        self.passes = [self.passes[i] for i in order]
        self._validated = True

    def _cycle_message(self, before: list[set[int]], done: set[int]) -> str:
        start = next(i for i in range(len(before)) if i not in done)
        path = [start]
        while True:
            nxt = min(j for j in before[path[-1]] if j not in done)
            if nxt in path:
                cycle = path[path.index(nxt):] + [nxt]
                break
            path.append(nxt)
        names = " -> ".join(pass_name(self.passes[i]) for i in reversed(cycle))
        return (f"pass constraints form a cycle: {names} (each must run before the next); "
                "remove one of the conflicting constraints.")

    # -- running -----------------------------------------------------------------------------

    def __call__(self, graph_module: GraphModule) -> PassResult:
        """Run the passes on (a copy of) ``graph_module``; return the result and whether it changed."""
        if not self._validated:
            self.solve_constraints()
        gm = graph_module if self.inplace else copy.deepcopy(graph_module)
        self._run_checks(gm, after=None, completed=())
        completed: list[str] = []
        overall = False
        for _ in range(self.steps):
            modified = False
            for p in self.passes:
                name = pass_name(p)
                logger.debug("running pass %r", name)
                gm, changed = self._run_one(p, name, gm, completed)
                modified = modified or changed
                completed.append(name)
                if self.run_checks_after_each_pass:
                    self._run_checks(gm, after=name, completed=completed[:-1])
            overall = overall or modified
            if not modified:
                break
        return PassResult(gm, overall)

    def _run_one(self, p: Pass, name: str, gm: GraphModule,
                 completed: list[str]) -> tuple[GraphModule, bool]:
        unchanged = "" if self.inplace else " The input GraphModule is unchanged."
        try:
            result = p(gm)
        except QplugError:
            raise  # already says what failed and how to fix it; wrapping would hide its type
        except Exception as e:
            raise PassError(f"pass {name!r} raised {type(e).__name__}: {e} (completed before it: "
                            f"{completed}).{unchanged}", pass_name=name,
                            completed_passes=completed) from e
        out, changed = self._normalise(result, gm, name, completed)
        if not changed or not self.recompile:  # recompiling costs ~0.2 s per 5k nodes
            return out, changed
        try:
            out.recompile()
        except Exception as e:
            raise PassError(f"pass {name!r} left a graph that does not compile to Python: "
                            f"{type(e).__name__}: {e}.{unchanged}", pass_name=name,
                            completed_passes=completed) from e
        return out, changed

    @staticmethod
    def _normalise(result: Any, gm: GraphModule, name: str,
                   completed: Iterable[str]) -> tuple[GraphModule, bool]:
        if result is None:
            return gm, True
        if isinstance(result, GraphModule):
            return result, True
        module = getattr(result, "graph_module", None)
        if isinstance(module, GraphModule):
            return module, bool(getattr(result, "modified", True))
        raise PassError(f"pass {name!r} returned {type(result).__name__}; a pass must return a "
                        "PassResult, a GraphModule, or None when it edits the module in place.",
                        pass_name=name, completed_passes=tuple(completed))

    def _run_checks(self, gm: GraphModule, *, after: str | None, completed: Sequence[str]) -> None:
        for check in self._checks:
            try:
                check(gm)
            except Exception as e:
                where = f"after pass {after!r}" if after else "before the first pass"
                msg = (f"check {pass_name(check)!r} failed {where}: {type(e).__name__}: {e}")
                if self.suppress_check_failures:
                    logger.warning("%s", msg)
                    continue
                raise PassError(msg + "; the input GraphModule is unchanged."
                                if not self.inplace else msg,
                                pass_name=after, completed_passes=completed) from e
