"""`harnessrl bench canary`: how often the canary rule (trust/canary.py) decides wrongly,
how often rightly, and how many sessions it takes, simulated (numpy, seeded, minutes).

Each run is one canary: sessions go to the candidate with probability --share, else to
stable, up to --max-sessions; each has a 0/1 reward (the arm's success rate) and two guard
observations (error, no answer: each failed with the arm's rate). The rule is checked after
every session, the way a service that looks at each one would (the most peeking it can
get), with its defaults except rewards in [0, 1] and `min_sessions` 100. SCENARIOS, stable's
success 0.6, errors 1%, no answers 2%:

- equal: the same arms; promotion is right, a rollback is a false rollback;
- boundary: the candidate worse by exactly delta; a promotion is a false promotion;
- harmful (-0.2) and helpful (+0.1): power, the share of runs decided rightly;
- guard_harmful: equal rewards, the candidate's error rate 10%: rightly rolled back by the
  error guard.

The rule is vectorised over runs and sessions with trust/canary.py's own `radius` and
`failure_bounds` (the guards' bounds only up to the session where the reward test stopped
the run); the first run of every scenario is replayed through `Canary` itself and must end
the same way. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from harnessrl.trust.canary import CanaryConfig

    Floats = npt.NDArray[np.float64]
    Bools = npt.NDArray[np.bool_]

STABLE_SUCCESS = 0.6
ERROR_RATE = 0.01
NO_ANSWER_RATE = 0.02
CHUNK = 50  # runs simulated at once (memory: about 20 arrays of CHUNK x max_sessions)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One simulated truth and the decision that is right under it."""

    name: str
    reward_change: float
    """The candidate's success rate minus stable's (None: minus delta, the boundary)."""
    candidate_error: float
    right: str
    right_reason: str


def scenarios(delta: float) -> tuple[Scenario, ...]:
    return (
        Scenario("equal", 0.0, ERROR_RATE, "promote", "reward"),
        Scenario("boundary", -delta, ERROR_RATE, "rollback", "reward"),
        Scenario("harmful", -0.2, ERROR_RATE, "rollback", "reward"),
        Scenario("helpful", 0.1, ERROR_RATE, "promote", "reward"),
        Scenario("guard_harmful", 0.0, 0.10, "rollback", "error"),
    )


@dataclass(frozen=True, slots=True)
class Sessions:
    """A chunk of runs' sessions, (runs, sessions) each."""

    candidate: Bools
    reward: Floats
    error: Bools
    no_answer: Bools


def draw(scenario: Scenario, runs: int, sessions: int, share: float, seed: int) -> Sessions:
    import numpy as np

    rng = np.random.default_rng(seed)
    candidate = rng.random((runs, sessions)) < share  # (R, N)
    success = np.where(candidate, STABLE_SUCCESS + scenario.reward_change, STABLE_SUCCESS)
    error = np.where(candidate, scenario.candidate_error, ERROR_RATE)  # (R, N)
    return Sessions(
        candidate=candidate,
        reward=(rng.random((runs, sessions)) < success).astype(np.float64),
        error=rng.random((runs, sessions)) < error,
        no_answer=rng.random((runs, sessions)) < NO_ANSWER_RATE,
    )


def decide(s: Sessions, config: CanaryConfig) -> tuple[Any, Any, Any]:
    """Per run: the decision ("promote", "rollback", "continue"), its reason, and the
    sessions (both arms) when it was taken (0: none within the run). The rule of
    Canary.decide, on every prefix of every run at once."""
    import numpy as np

    from harnessrl.trust.canary import radius

    c = s.candidate  # (R, N)
    n_c = np.cumsum(c, axis=1).astype(np.float64)  # (R, N)
    n_s = np.arange(1, c.shape[1] + 1)[None, :] - n_c  # (R, N)
    m = config.mixture_sessions

    def interval(x: Floats, sigma: float, alpha: float) -> tuple[Floats, Floats]:
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.cumsum(x * c, axis=1) / n_c - np.cumsum(x * ~c, axis=1) / n_s  # (R, N)
            r = radius(n_c, sigma, m, alpha / 2) + radius(n_s, sigma, m, alpha / 2)  # (R, N)
        return np.nan_to_num(d - r, nan=-np.inf), np.nan_to_num(d + r, nan=np.inf)

    ready = np.minimum(n_c, n_s) >= config.min_sessions  # (R, N)
    sigma = (config.high - config.low) / 2.0
    lower, upper = interval(s.reward, sigma, config.alpha)
    reasons = ["error", "no_answer", "reward", "reward"]
    by_reward = [ready & (upper < 0.0), ready & (lower > -config.delta)]
    # The guards only matter before the reward test stops a run: their (costlier) bounds
    # are computed up to the last session any run of the chunk is still going.
    ends: Any = np.logical_or(*by_reward)  # (R, N)
    horizon = int(np.where(ends.any(axis=1), ends.argmax(axis=1), c.shape[1] - 1).max()) + 1
    stops = []
    for name, failed in (("error", s.error), ("no_answer", s.no_answer)):
        rule = config.guards[name]
        guard = np.zeros_like(ready)
        guard[:, :horizon] = ready[:, :horizon] & (
            guard_lower(failed[:, :horizon], c[:, :horizon], rule.alpha) > rule.margin
        )
        stops.append(guard)
    stops += by_reward
    stop = np.stack(stops)  # (4, R, N): the checks in Canary.decide's order
    first = np.where(stop.any(axis=2), stop.argmax(axis=2), c.shape[1])  # (4, R)
    when = first.min(axis=0)  # (R,)
    which = np.where(first == when, np.arange(4)[:, None], 4).min(axis=0)  # (R,)
    action = np.array(["rollback", "rollback", "rollback", "promote", "continue"])[which]
    reason = np.array([*reasons, "undecided"])[which]
    return action, reason, np.where(which < 4, when + 1, 0)


def guard_lower(failed: Any, candidate: Any, alpha: float) -> Any:
    """Per session, the lower bound on candidate minus stable failure rate (Canary.decide's
    `rate_difference`, on every prefix at once); -inf while an arm is empty."""
    import numpy as np

    from harnessrl.trust.canary import failure_bounds

    n_c = np.cumsum(candidate, axis=1).astype(np.float64)
    n_s = np.arange(1, candidate.shape[1] + 1)[None, :] - n_c
    f_c = np.cumsum(failed & candidate, axis=1).astype(np.float64)
    f_s = np.cumsum(failed & ~candidate, axis=1).astype(np.float64)
    low_c, _ = failure_bounds(f_c, n_c, alpha / 2)
    _, high_s = failure_bounds(f_s, n_s, alpha / 2)
    return np.where((n_c > 0) & (n_s > 0), low_c - high_s, -np.inf)


def replay(s: Sessions, run: int, config: CanaryConfig) -> tuple[str, str, int]:
    """Run `run` through Canary itself, deciding after every session."""
    from harnessrl.trust.canary import Canary

    canary = Canary(config)
    for i in range(s.candidate.shape[1]):
        arm = "candidate" if s.candidate[run, i] else "stable"
        guards = {"error": bool(s.error[run, i]), "no_answer": bool(s.no_answer[run, i])}
        canary.observe(arm, float(s.reward[run, i]), guards)
        decision = canary.decide()
        if decision.action != "continue":
            return decision.action, decision.reason, i + 1
    return "continue", "undecided", 0


def measure(scenario: Scenario, args: argparse.Namespace, config: CanaryConfig) -> dict[str, float]:
    import numpy as np

    actions, reasons, whens = [], [], []
    for start in range(0, args.runs, CHUNK):
        runs = min(CHUNK, args.runs - start)
        s = draw(scenario, runs, args.max_sessions, args.share, args.seed + start)
        action, reason, when = decide(s, config)
        if start == 0:
            vectorised = (str(action[0]), str(reason[0]), int(when[0]))
            replayed = replay(s, 0, config)
            if vectorised != replayed:
                raise SystemExit(f"bench canary: {vectorised} != Canary's {replayed}")
        actions.append(action)
        reasons.append(reason)
        whens.append(when)
    action, reason, when = np.concatenate(actions), np.concatenate(reasons), np.concatenate(whens)
    right = (action == scenario.right) & (reason == scenario.right_reason)
    decided = action != "continue"
    return {
        "promote": float((action == "promote").mean()),
        "rollback": float((action == "rollback").mean()),
        "rollback_by_guard": float(((action == "rollback") & (reason != "reward")).mean()),
        "undecided": float((~decided).mean()),
        "right": float(right.mean()),
        "median_sessions": float(np.median(when[decided])) if decided.any() else float("nan"),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (for `harnessrl bench canary`)."""
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--runs", type=int, default=1000, help="runs per scenario (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first run (default 0)")
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=40_000,
        help="sessions (both arms) a run may last (default 40000)",
    )
    parser.add_argument(
        "--share", type=float, default=0.5, help="the candidate's share of sessions (default 0.5)"
    )


def main(args: argparse.Namespace) -> int:
    """Every scenario; prints the JSON line last. Returns 0."""
    from harnessrl.trust.canary import CanaryConfig

    if args.runs < 1 or args.max_sessions < 1 or not 0.0 < args.share < 1.0:
        raise SystemExit("bench canary: --runs, --max-sessions >= 1, --share in (0, 1)")
    config = CanaryConfig(low=0.0, high=1.0, min_sessions=100)
    table: dict[str, dict[str, float]] = {}
    for scenario in scenarios(config.delta):
        table[scenario.name] = measure(scenario, args, config)
        print(f"bench canary: {scenario.name}: {table[scenario.name]}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "runs": args.runs,
        "seed": args.seed,
        "max_sessions": args.max_sessions,
        "share": args.share,
        "alpha": config.alpha,
        "delta": config.delta,
        "guards": {n: {"margin": g.margin, "alpha": g.alpha} for n, g in config.guards.items()},
        "min_sessions": config.min_sessions,
        "mixture_sessions": config.mixture_sessions,
        "stable": {"success": STABLE_SUCCESS, "error": ERROR_RATE, "no_answer": NO_ANSWER_RATE},
        "false_rollback_equal": table["equal"]["rollback"],
        "false_promotion_boundary": table["boundary"]["promote"],
        "scenarios": table,
    }
    if not args.json:
        for name, row in table.items():
            print(f"{name:>14}: {row}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0
