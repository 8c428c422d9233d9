"""`harnessrl feedback send|show|delete`: an app's feedback about one of its production
sessions, sent to the reward service's feedback API with the app's own key (read from an
environment variable, never from the command line, where other users of the machine could
see it); `delete` takes a session back (nothing of it is kept or trained from then on)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from harnessrl.command import CliError

DEFAULT_URL = "http://127.0.0.1:8260"
"""The feedback API of a local reward service (reward.feedback_port's default)."""
DEFAULT_KEY_ENV = "HARNESSRL_APP_KEY"


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "feedback",
        help="send feedback about a production session, show or delete a session",
        description="Talk to the reward service's feedback API as a production app: send a "
        "signal about one of the app's sessions (thumbs, resolved, ...), or show a session's "
        "state, its signals and its decided reward. The app's key is read from an "
        f"environment variable (--app-key-env, default {DEFAULT_KEY_ENV}).",
    )
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    send = actions.add_parser("send", help="send one feedback signal about a session")
    send.add_argument("session", metavar="SESSION", help="the app's session id")
    send.add_argument("name", metavar="NAME", help="the signal (production.feedback.signals)")
    send.add_argument("value", metavar="VALUE", help="its value, a finite number")
    send.add_argument("--response", metavar="ID", help="the response the signal is about")
    send.add_argument(
        "--key",
        metavar="IDEMPOTENCY_KEY",
        help="the signal's idempotency key (default: a digest of name, value and response, "
        "so repeating the same command is the same signal)",
    )
    _common(send)
    send.set_defaults(run=run_send)
    show = actions.add_parser("show", help="show a session: state, signals, decided reward")
    show.add_argument("session", metavar="SESSION", help="the app's session id")
    _common(show)
    show.set_defaults(run=run_show)
    delete = actions.add_parser(
        "delete",
        help="delete a session: its signals and reward purged, its training data dropped",
        description="Delete one of the app's sessions: the reward service purges its "
        "signals and reward, and the trainer drops what of it has not trained yet. Prints "
        "the answer: applied (the trainer confirmed) and the policy versions that had "
        "already trained on it; applied false means the trainer has not confirmed yet "
        "(`show` tells once it has). Deleting again is harmless.",
    )
    delete.add_argument("session", metavar="SESSION", help="the app's session id")
    _common(delete)
    delete.set_defaults(run=run_delete)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"the feedback API (default {DEFAULT_URL})"
    )
    parser.add_argument(
        "--app-key-env",
        default=DEFAULT_KEY_ENV,
        metavar="VAR",
        help=f"environment variable holding the app's key (default {DEFAULT_KEY_ENV})",
    )


def run_send(args: argparse.Namespace) -> int:
    try:
        value = float(args.value)
    except ValueError:
        raise CliError(f"VALUE: {args.value!r} is not a number") from None
    if not math.isfinite(value):
        raise CliError(f"VALUE: {args.value!r} is not a finite number")
    body: dict[str, Any] = {"session": args.session, "name": args.name, "value": value}
    if args.response is not None:
        body["response_id"] = args.response
    if args.key is not None:
        body["idempotency_key"] = args.key
    answer = _call(args, "POST", "/v1/feedback", body)
    print(json.dumps(answer, indent=2))
    return 0


def run_show(args: argparse.Namespace) -> int:
    answer = _call(args, "GET", f"/v1/sessions/{args.session}", None)
    print(json.dumps(answer, indent=2))
    return 0


def run_delete(args: argparse.Namespace) -> int:
    answer = _call(args, "DELETE", f"/v1/sessions/{args.session}", None)
    print(json.dumps(answer, indent=2))
    return 0


def _call(
    args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None
) -> dict[str, Any]:
    """The API's JSON answer; CliError naming what went wrong (no key, no connection, or
    the API's own error message and field)."""
    import httpx

    key = os.environ.get(args.app_key_env, "")
    if not key:
        raise CliError(f"{args.app_key_env}: not set; export the app's key in it")
    url = args.url.rstrip("/") + path
    # A DELETE waits for the trainer up to reward.delete_wait_s (at most 600 s).
    timeout = 630.0 if method == "DELETE" else 30.0
    try:
        response = httpx.request(
            method, url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=timeout
        )
    except httpx.HTTPError as err:
        raise CliError(f"{url}: {err or type(err).__name__}") from None
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise CliError(f"{url}: HTTP {response.status_code}, not a JSON object")
    if response.status_code >= 400:
        error = answer.get("error")
        if not isinstance(error, dict):
            error = {}
        field = f" (field {error['field']})" if error.get("field") else ""
        message = error.get("message", response.text[:200])
        raise CliError(f"{url}: HTTP {response.status_code}: {message}{field}")
    return answer
