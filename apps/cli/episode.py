"""`harnessrl episode open|close`: an episode of a running `harnessrl up`, opened by hand, so
a harness run from a shell (yours, under development) talks to the stack's gateway.

`open` mints an episode token with the stack's token secret as the controller mints one
and prints the variables a harness reads; `close` closes the episode at the gateway's
admin API, which publishes its EpisodeClosed. Nothing goes to hrl.episodes (see
`_PIPELINE`): the gateway's ModelCalls and EpisodeClosed are the whole record.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from harnessrl.apps.up.stackfile import DEFAULT_WORKDIR, MANUAL_EPISODES_FILE, STACK_FILE
from harnessrl.command import CliError

if TYPE_CHECKING:
    from harnessrl.apps.up.manual_episodes import ManualEpisode
    from harnessrl.apps.up.stackfile import GatewayAccess

T = TypeVar("T")

DEFAULT_STACK = DEFAULT_WORKDIR / STACK_FILE
DEFAULT_TTL_S = 3600.0
CLOSE_TIMEOUT_S = 30.0
"""How long `close` retries while the gateway answers 503 (restarting, recovering)."""
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

_PIPELINE = (
    "Nothing is published on hrl.episodes (no EpisodeStarted, no EpisodeFinished): the "
    "episode has no task, so the reward service never scores it and the sample builder "
    "never trains on it, whatever --mode (the sample builder holds its calls until "
    "sample_builder.group_timeout_s, then drops them)."
)


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "episode",
        help="open and close an episode by hand on a running `harnessrl up`",
        description="Point a harness you run yourself at the stack's gateway: `open` prints "
        'its variables (eval "$(harnessrl episode open)"), `close` closes it at the gateway.',
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    opener = sub.add_parser(
        "open",
        help="open an episode and print the shell exports that point a harness at it",
        description="Open an episode on the running stack and print `export` lines for "
        "OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY, then a "
        'comment naming the episode and how to close it: eval "$(harnessrl episode open)" '
        "and run your harness in that shell. The token is minted with the stack's token "
        "secret as the controller mints one (episode <group>-manual-<n>, attempt 1), so the "
        "gateway serves its calls and puts each on hrl.calls as a ModelCall. "
        + _PIPELINE
        + " --mode only picks the gateway's sampling: val keeps the harness's own settings "
        "(as in production), train forces gateway.train's (as in training).",
    )
    opener.add_argument(
        "--mode",
        choices=("train", "val"),
        default="val",
        help="the token's mode: which sampling the gateway forces (default val: none)",
    )
    _add_stack_option(opener)
    opener.add_argument(
        "--group",
        type=_identifier,
        metavar="ID",
        help="group id of the episode (default: a fresh one, as `harnessrl submit` makes)",
    )
    opener.add_argument(
        "--ttl",
        type=_positive,
        default=DEFAULT_TTL_S,
        metavar="SECONDS",
        help=f"how long the token works (default {DEFAULT_TTL_S:g})",
    )
    opener.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (ids, mode, expiry, token, the variables) instead",
    )
    opener.set_defaults(run=run_open)
    closer = sub.add_parser(
        "close",
        help="close an episode at the gateway and print its call count",
        description="Close the episode at the gateway's admin API (POST "
        "/admin/episodes/EPISODE_ID/close with the stack's admin token): further calls with "
        "its token are refused (409), and once its calls are on hrl.calls the gateway "
        "publishes EpisodeClosed{call_count}; prints that count. Closing again prints the "
        "same count. The attempt and group of an episode `open` made are taken from its "
        f"record beside the stack file ({MANUAL_EPISODES_FILE}).",
    )
    closer.add_argument("episode_id", type=_identifier, metavar="EPISODE_ID")
    closer.add_argument(
        "--attempt",
        type=_positive_int,
        metavar="N",
        help="attempt to close (default: the recorded one, else 1)",
    )
    closer.add_argument(
        "--group",
        type=_identifier,
        metavar="ID",
        help="group id (default: the recorded one; required for an episode `open` did not "
        "make here)",
    )
    _add_stack_option(closer)
    closer.add_argument(
        "--reason",
        default="manual",
        metavar="TEXT",
        help="reason recorded on EpisodeClosed (default manual)",
    )
    closer.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a line"
    )
    closer.set_defaults(run=run_close)
    parser.set_defaults(run=lambda _: parser.print_help() or 2)


def _add_stack_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stack",
        type=Path,
        metavar="FILE",
        help=f"stack file of the running `harnessrl up` (default {DEFAULT_STACK}, what "
        "`harnessrl up` run here writes)",
    )


def run_open(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import time

    from harnessrl.apps.up.manual_episodes import record_new
    from harnessrl.episode_token import EpisodeClaims, harness_env, mint
    from harnessrl.tasks import new_group_id

    stack = args.stack or DEFAULT_STACK
    access = _access(stack)
    asyncio.run(_check_health(access.url))
    expires_at = time.time() + args.ttl
    episode = _recorded(
        lambda: record_new(_record(stack), args.group or new_group_id(), args.mode, expires_at)
    )
    claims = EpisodeClaims(
        episode.episode_id, episode.attempt, episode.group_id, episode.mode, expires_at
    )
    token = mint(claims, access.token_secret.encode())
    env = harness_env(access.url, token)
    if args.json:
        data = {
            "episode_id": episode.episode_id,
            "attempt": episode.attempt,
            "group_id": episode.group_id,
            "mode": episode.mode,
            "expires_at": round(expires_at, 3),
            "token": token,
            "env": env,
        }
        print(json.dumps(data))
        return 0
    print(shell_exports(env, episode, args.stack))
    return 0


def run_close(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from harnessrl.apps.up.manual_episodes import find

    stack = args.stack or DEFAULT_STACK
    access = _access(stack)
    recorded = _recorded(lambda: find(_record(stack), args.episode_id))
    group_id = args.group or (recorded.group_id if recorded else None)
    if group_id is None:
        raise CliError(
            f"episode {args.episode_id}: not opened with `harnessrl episode open` on this "
            f"stack ({_record(stack)} does not name it); pass --group ID (and --attempt N)"
        )
    attempt = args.attempt or (recorded.attempt if recorded else 1)
    count = asyncio.run(_close(access, args.episode_id, attempt, group_id, args.reason))
    if args.json:
        data = {
            "episode_id": args.episode_id,
            "attempt": attempt,
            "group_id": group_id,
            "call_count": count,
        }
        print(json.dumps(data))
    else:
        print(f"closed {args.episode_id} (attempt {attempt}, group {group_id}): call_count {count}")
    return 0


def _access(stack: Path) -> GatewayAccess:
    from harnessrl.apps.up.stackfile import StackFileError, read_gateway_access

    try:
        return read_gateway_access(stack)
    except FileNotFoundError:
        raise CliError(
            f"no running stack: {stack} does not exist (start `harnessrl up` here, or pass "
            "--stack FILE)"
        ) from None
    except StackFileError as err:
        raise CliError(str(err)) from err
    except OSError as err:
        raise CliError(f"{stack}: {err.strerror}") from err


def _record(stack: Path) -> Path:
    return stack.parent / MANUAL_EPISODES_FILE


def _recorded(read: Callable[[], T]) -> T:
    """`read()` of the manual-episode record; its StackFileError or OSError as a CliError."""
    from harnessrl.apps.up.stackfile import StackFileError

    try:
        return read()
    except StackFileError as err:
        raise CliError(str(err)) from err
    except OSError as err:
        raise CliError(f"{err.filename}: {err.strerror}") from err


def shell_exports(env: dict[str, str], episode: ManualEpisode, stack: Path | None) -> str:
    """`export NAME=value` per variable, then a comment naming the episode and the command
    that closes it (with `--stack` when one was given): what `eval` runs in a shell."""
    import time

    lines = [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(episode.expires_at))
    close = ["harnessrl", "episode", "close", episode.episode_id]
    if stack is not None:
        close += ["--stack", str(stack)]
    lines.append(
        f"# episode {episode.episode_id} (attempt {episode.attempt}, group "
        f"{episode.group_id}, mode {episode.mode}, token valid until {expires}); "
        f"close it with: {shlex.join(close)}"
    )
    return "\n".join(lines)


async def _check_health(url: str) -> None:
    """CliError unless the service at `url` answers /healthz with 200 (a stale stack file
    fails here, at once, rather than at the harness's first call)."""
    import httpx

    try:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(10.0, connect=2.0)) as c:
            response = await c.get("/healthz")
    except httpx.InvalidURL as err:
        raise CliError(f"gateway URL in the stack file: {err}") from err
    except (httpx.HTTPError, OSError) as err:
        raise CliError(
            f"the gateway at {url} cannot be reached ({err!r}): is `harnessrl up` still running?"
        ) from err
    if response.status_code != 200:
        raise CliError(f"the gateway at {url}: /healthz answered {response.status_code}")


async def _close(
    access: GatewayAccess, episode_id: str, attempt: int, group_id: str, reason: str
) -> int:
    import httpx

    from harnessrl.services.controller.gateway_admin import GatewayAdmin, GatewayCloseError

    await _check_health(access.admin_url)
    admin = GatewayAdmin(access.admin_url, access.admin_token, timeout_s=CLOSE_TIMEOUT_S)
    try:
        return await admin.close_episode(episode_id, attempt, group_id, reason=reason)
    except (GatewayCloseError, httpx.HTTPError) as err:
        raise CliError(str(err) or repr(err)) from err
    finally:
        await admin.close()


def _identifier(text: str) -> str:
    if not _ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: letters, digits, '.', '_' and '-' only (at most 128, starting with a "
            "letter or digit)"
        )
    return text


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number of seconds")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 1 or more")
    return value
