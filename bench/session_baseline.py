"""`harnessrl bench baseline`: what a production session's baseline does to the policy
gradient, simulated (numpy, seeded, seconds on a CPU).

A population of sessions of five kinds under two apps (KINDS: success rates 0.2 to 0.8,
rewards 0/1 or thumbs ±1, plus Gaussian noise of sd --noise) arrives at RATE sessions an
hour; each session's reward is decided DELAY_H hours later on average (exponential), so
rewards arrive out of order. The trainer takes one step per WINDOW_H hours of decisions,
with the sessions decided in it, in the order they were decided. The policy is a softmax
over ACTIONS actions per kind, whose score function is known in closed form:

    grad_theta[k] log pi(a | k) = onehot(a) - pi[k]      (and 0 for the other kinds)

so the per-session policy-gradient estimate is g = A * grad log pi(a | k), a vector of
len(KINDS) * ACTIONS parameters. The estimators of A (ESTIMATORS):

- none: A = R;
- global_mean: R minus one running mean over every session (Baselines, one key);
- per_kind: R minus the per-(app, kind) running baseline of trust/session_baseline.py
  (falls back to the app's below min_count rewards); per_kind_scaled: also divided by its
  running std;
- cohort_loo: R minus the mean of the other sessions of its kind decided in the same
  window (0 when it is alone there);
- oracle: R minus the true E[R | kind] under the acting policy (the best a kind's baseline
  can do; a reference, not something production knows).

`variance`: the policy held at uniform, --sessions sessions, the same sessions for every
estimator. Per estimator: the gradient variance (the sum over parameters of the variance
of g across sessions), its ratio to none's, and the mean of g against the true gradient:
bias_rel = |mean g - true| / |true| beside noise_rel = sqrt(variance / sessions) / |true|
(what bias_rel is from sampling noise alone), their cosine, and the largest |A| (one
session weighing many).

`convergence`: a policy-gradient loop (theta += --lr * mean g over each window, g taken at
the policy that acted) over --train-sessions sessions per run, --runs runs with seeds from
--seed on, the same sessions and random draws for every estimator; the expected success
rate of the policy when the last session starts (mean and standard error over runs).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Floats = npt.NDArray[np.float64]
    Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class SessionKind:
    """One kind of session in the simulated population."""

    app: str
    kind: str
    success: float
    """Success rate under the uniform policy (the actions spread around it by SPREAD)."""
    thumbs: bool
    """Reward +1/-1 (a thumb) rather than 1/0."""
    share: float
    """Fraction of the sessions."""


KINDS = (
    SessionKind("support", "refund", 0.2, thumbs=False, share=0.35),
    SessionKind("support", "billing", 0.5, thumbs=False, share=0.30),
    SessionKind("support", "faq", 0.8, thumbs=False, share=0.15),
    SessionKind("assistant", "code", 0.5, thumbs=True, share=0.18),
    SessionKind("assistant", "rare", 0.8, thumbs=True, share=0.02),
)
ACTIONS = 4
SPREAD = 0.15  # action a's success rate: success + SPREAD * (-1, -1/3, 1/3, 1)
RATE = 400.0  # sessions started per hour
DELAY_H = 3.0  # mean hours from a session's start to its reward's decision
WINDOW_H = 0.25  # hours of decisions per trainer step (and per cohort)
ESTIMATORS = (
    "none",
    "global_mean",
    "per_kind",
    "per_kind_scaled",
    "cohort_loo",
    "oracle",
)


@dataclass(frozen=True, slots=True)
class SimulationSettings:
    """What the options change: the running baselines' settings, the rewards' noise, the
    convergence loop's step size."""

    halflife: float = 200.0
    min_count: int = 10
    noise: float = 0.1
    """sd of the Gaussian noise added to every reward (0: rewards exactly 0/1 and ±1)."""
    lr: float = 8.0
    """Step size of the convergence loop, on the mean g of a window."""


@dataclass(frozen=True, slots=True)
class Decided:
    """The sessions decided in one window, in the order they were decided."""

    kind: Ints  # (n,)
    reward: Floats  # (n,)
    value: Floats  # (n,) E[R | kind] under the policy that acted


Advantage = Callable[[Decided], "Floats"]


@dataclass(frozen=True, slots=True)
class SimulatedRun:
    """One simulated run with one estimator."""

    advantage: Floats  # (n,) of every session decided before the end, else nan
    grad: Floats  # (n, K*A) grad log pi of each session's action, at the acting policy
    theta: Floats  # (K, A) the policy's logits at the end


def estimator(name: str, settings: SimulationSettings) -> Advantage:
    """A stateful advantage function, called once per window in decision order."""
    import numpy as np

    from harnessrl.trust.session_baseline import Baselines, Key, session_keys

    if name == "none":
        return lambda d: d.reward.copy()
    if name == "oracle":
        return lambda d: d.reward - d.value
    if name == "cohort_loo":

        def cohort(d: Decided) -> Floats:
            count = np.bincount(d.kind, minlength=len(KINDS))[d.kind]  # (n,)
            total = np.bincount(d.kind, d.reward, minlength=len(KINDS))[d.kind]  # (n,)
            others = np.where(count > 1, (total - d.reward) / np.maximum(count - 1, 1), 0.0)
            return d.reward - others

        return cohort
    if name not in ("global_mean", "per_kind", "per_kind_scaled"):
        raise ValueError(f"estimator: {name!r} is not one of {ESTIMATORS}")
    keys: list[list[Key]]
    if name == "global_mean":
        keys = [[("all",)] for _ in KINDS]
    else:
        keys = [session_keys(k.app, k.kind) for k in KINDS]
    scale = name == "per_kind_scaled"
    baselines = Baselines(halflife=settings.halflife, min_count=settings.min_count, scale=scale)

    def running(d: Decided) -> Floats:
        pairs = zip(d.kind.tolist(), d.reward.tolist(), strict=True)
        return np.array([baselines.advantage(keys[k], r) for k, r in pairs], dtype=np.float64)

    return running


def success_rates() -> Floats:
    """P(success | kind, action), (K, A): a thumb up counts as a success."""
    import numpy as np

    offsets = np.linspace(-1.0, 1.0, ACTIONS)  # (A,)
    return np.array([k.success for k in KINDS])[:, None] + SPREAD * offsets  # (K, A)


def expected_rewards() -> Floats:
    """E[R | kind, action], (K, A)."""
    import numpy as np

    thumbs = np.array([k.thumbs for k in KINDS])[:, None]  # (K, 1)
    return np.where(thumbs, 2.0 * success_rates() - 1.0, success_rates())


def success_rate(theta: Floats | None) -> float:
    """The policy's expected success rate over the population; None: the best policy's."""
    import numpy as np

    shares = np.array([k.share for k in KINDS])  # (K,)
    if theta is None:
        return float(shares @ success_rates().max(axis=1))
    return float(shares @ (_softmax(theta) * success_rates()).sum(axis=1))


def true_gradient(theta: Floats) -> Floats:
    """grad_theta E[R] = sum_k share_k pi_k * (r_k - pi_k . r_k), flattened to (K*A,)."""
    import numpy as np

    pi = _softmax(theta)  # (K, A)
    r = expected_rewards()  # (K, A)
    shares = np.array([k.share for k in KINDS])[:, None]  # (K, 1)
    value = (pi * r).sum(axis=1, keepdims=True)  # (K, 1)
    gradient: Floats = (shares * pi * (r - value)).ravel()  # (K*A,)
    return gradient


def simulate(
    name: str, sessions: int, seed: int, *, lr: float, settings: SimulationSettings
) -> SimulatedRun:
    """Sessions start at RATE an hour; each window, the ones starting act under the current
    policy, then the ones decided are scored by `name` and the policy takes a step of `lr`
    (0: the policy stays uniform). Same seed: same sessions and draws for every estimator."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shares = np.array([k.share for k in KINDS])
    kind = rng.choice(len(KINDS), sessions, p=shares / shares.sum())  # (n,)
    start = np.arange(sessions) / RATE  # (n,) hours
    decided = start + rng.exponential(DELAY_H, sessions)  # (n,)
    u_action, u_success = rng.random(sessions), rng.random(sessions)  # (n,), (n,)
    noise = rng.normal(0.0, settings.noise, sessions)  # (n,)
    thumbs = np.array([k.thumbs for k in KINDS])[kind]  # (n,)
    r_mean = expected_rewards()  # (K, A)
    success_p = success_rates()[kind]  # (n, A)

    windows = math.ceil((start[-1] + 1e-9) / WINDOW_H)
    started = np.searchsorted(start, np.arange(windows + 1) * WINDOW_H)  # (W+1,)
    order = np.argsort(decided, kind="stable")  # (n,)
    ends = np.searchsorted(decided[order], np.arange(1, windows + 1) * WINDOW_H)  # (W,)

    theta = np.zeros((len(KINDS), ACTIONS))  # (K, A)
    action = np.zeros(sessions, dtype=np.int64)  # (n,)
    reward = np.zeros(sessions)  # (n,)
    value = np.zeros(sessions)  # (n,)
    grad = np.zeros((sessions, len(KINDS), ACTIONS))  # (n, K, A)
    advantage = np.full(sessions, np.nan)  # (n,)
    advantage_of = estimator(name, settings)
    done = 0
    for w in range(windows):
        new = slice(started[w], started[w + 1])
        pi = _softmax(theta)[kind[new]]  # (m, A)
        action[new] = (
            (u_action[new, None] > np.cumsum(pi, axis=1)).sum(axis=1).clip(max=ACTIONS - 1)
        )
        hit = u_success[new] < success_p[new][np.arange(len(pi)), action[new]]  # (m,)
        reward[new] = np.where(thumbs[new], 2.0 * hit - 1.0, hit) + noise[new]
        value[new] = (pi * r_mean[kind[new]]).sum(axis=1)
        rows = np.arange(started[w], started[w + 1])
        grad[rows, kind[new]] = -pi
        grad[rows, kind[new], action[new]] += 1.0

        batch = order[done : ends[w]]  # decided in window w; every one has started
        done = ends[w]
        if not len(batch):
            continue
        advantage[batch] = advantage_of(Decided(kind[batch], reward[batch], value[batch]))
        if lr:
            theta += lr * (advantage[batch, None, None] * grad[batch]).mean(axis=0)
    return SimulatedRun(advantage, grad.reshape(sessions, -1), theta)


def measure_variance(
    sessions: int, seed: int, settings: SimulationSettings, log: Callable[[str], None]
) -> dict[str, dict[str, float]]:
    """Per estimator, the per-session gradient estimate's variance and bias (uniform policy)."""
    import numpy as np

    true = true_gradient(np.zeros((len(KINDS), ACTIONS)))  # (P,)
    norm = float(np.linalg.norm(true))
    out: dict[str, dict[str, float]] = {}
    for name in ESTIMATORS:
        run = simulate(name, sessions, seed, lr=0.0, settings=settings)
        scored = ~np.isnan(run.advantage)  # (n,) the sessions decided within the run
        g = run.advantage[scored, None] * run.grad[scored]  # (m, P)
        variance = float(g.var(axis=0, ddof=1).sum())
        mean = g.mean(axis=0)  # (P,)
        out[name] = {
            "grad_variance": variance,
            "ratio_to_none": variance / out["none"]["grad_variance"] if out else 1.0,
            "bias_rel": float(np.linalg.norm(mean - true)) / norm,
            "noise_rel": math.sqrt(variance / len(g)) / norm,
            "cosine": float(mean @ true) / (float(np.linalg.norm(mean)) * norm),
            "max_abs_advantage": float(np.abs(run.advantage[scored]).max()),
        }
        figures = out[name]
        log(
            f"variance {name}: {variance:.5f} ({figures['ratio_to_none']:.3f}x none), bias "
            f"{figures['bias_rel']:.3f} of |true| (noise {figures['noise_rel']:.3f})"
        )
    return out


def measure_convergence(
    sessions: int, runs: int, seed: int, settings: SimulationSettings, log: Callable[[str], None]
) -> dict[str, dict[str, float]]:
    """Per estimator, the success rate after `sessions` sessions of the policy-gradient loop."""
    import numpy as np

    out: dict[str, dict[str, float]] = {}
    for name in ESTIMATORS:
        rates = np.array(
            [
                success_rate(
                    simulate(name, sessions, seed + i, lr=settings.lr, settings=settings).theta
                )
                for i in range(runs)
            ]
        )
        stderr = float(rates.std(ddof=1) / math.sqrt(runs)) if runs > 1 else 0.0
        out[name] = {"success_rate": float(rates.mean()), "stderr": stderr}
        log(f"convergence {name}: success {rates.mean():.4f} ± {stderr:.4f} over {runs} runs")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (for `harnessrl bench baseline`)."""
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--sessions",
        type=int,
        default=100_000,
        help="sessions of the variance measurement (default 100000)",
    )
    parser.add_argument(
        "--train-sessions",
        type=int,
        default=5_000,
        help="sessions per run of the convergence loop (default 5000)",
    )
    parser.add_argument(
        "--runs", type=int, default=16, help="convergence runs per estimator (default 16)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sessions (default 0)")
    parser.add_argument(
        "--halflife",
        type=float,
        default=200.0,
        help="the running baselines' half-life in rewards (default 200, production's)",
    )
    parser.add_argument(
        "--min-count",
        type=int,
        default=10,
        help="rewards a kind needs before its own estimate is used (default 10)",
    )
    parser.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="sd of the Gaussian noise added to every reward (default 0.1; 0: exact 0/1, ±1)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=8.0,
        help="step size of the convergence loop, on each window's mean gradient (default 8)",
    )


def main(args: argparse.Namespace) -> int:
    """Run both measurements; prints the JSON line last. Returns 0."""

    def log(line: str) -> None:
        print(f"bench baseline: {line}", file=sys.stderr, flush=True)

    if args.sessions < 2 or args.train_sessions < 2 or args.runs < 1:
        raise SystemExit("bench baseline: --sessions and --train-sessions >= 2, --runs >= 1")
    import numpy as np

    settings = SimulationSettings(args.halflife, args.min_count, args.noise, args.lr)
    result: dict[str, Any] = {
        "seed": args.seed,
        "sessions": args.sessions,
        "kinds": [asdict(k) for k in KINDS],
        "actions": ACTIONS,
        "noise_sd": settings.noise,
        "sessions_per_h": RATE,
        "mean_delay_h": DELAY_H,
        "window_h": WINDOW_H,
        "halflife": settings.halflife,
        "min_count": settings.min_count,
        "variance": measure_variance(args.sessions, args.seed, settings, log),
        "convergence": {
            "train_sessions": args.train_sessions,
            "runs": args.runs,
            "seeds": [args.seed + i for i in range(args.runs)],
            "lr": settings.lr,
            "uniform_success_rate": success_rate(np.zeros((len(KINDS), ACTIONS))),
            "best_success_rate": success_rate(None),
            **measure_convergence(args.train_sessions, args.runs, args.seed, settings, log),
        },
    }
    if not args.json:
        for section in ("variance", "convergence"):
            for key, value in result[section].items():
                print(f"{section:>12} {key:>16}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


def _softmax(theta: Floats) -> Floats:
    import numpy as np

    z = np.exp(theta - theta.max(axis=-1, keepdims=True))  # (..., A)
    pi: Floats = z / z.sum(axis=-1, keepdims=True)  # (..., A)
    return pi
