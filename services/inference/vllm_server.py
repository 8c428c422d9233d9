"""A `vllm serve` as a weight loader: the version it serves, and swapping in a newer one.

`VllmServer` is the PolicyFollower's loader for vLLM (services/inference/follower.py). It
speaks to the dev-mode endpoints (VLLM_SERVER_DEV_MODE=1: /pause, /resume,
/collective_rpc) through harnessrl.weights.vllm_worker, whose worker extension must be
loaded in vLLM. Failures are sorted as the follower expects them: the trainer no longer
holding a version is VersionGone, vLLM or the trainer unreachable is retryable, anything
else (bytes that fail verification, an endpoint that answers an error) is a refusal.

UNTESTED against a real vLLM, which cannot run here; see services/inference/vllm_sync.py.
"""

from __future__ import annotations

from typing import Any

from harnessrl.retry import RetryableError, is_retryable
from harnessrl.services.inference.follower import NotAnAdapter, VersionGone


class VllmUnusable(Exception):
    """vLLM answers, but not as a server with the dev-mode endpoints and the extension."""


class VllmServer:
    """One `vllm serve`, driven over HTTP. Not safe for concurrent `load`/`check` calls:
    the caller serialises them."""

    def __init__(
        self,
        url: str,
        *,
        initial_version: int,
        pause_mode: str,
        rpc_timeout_s: float,
    ) -> None:
        self.url = url
        self._initial = initial_version
        self._pause_mode = pause_mode
        self._timeout_s = rpc_timeout_s
        self._version = initial_version

    @property
    def version(self) -> int:
        """The version vLLM serves as of the last check or load."""
        return self._version

    @property
    def served_model(self) -> str:
        return ""  # full weights: vLLM serves every version under its own model name

    @property
    def served(self) -> dict[int, str]:
        """The one version vLLM serves, under its own model name."""
        return {self._version: ""}

    @property
    def adapters(self) -> bool:
        return False

    @property
    def keep(self) -> int:
        return 0

    async def add(self, address: str, version: int, *, adapter_only: bool = False) -> None:
        """Full weights replace the version served: `load`, whichever is newer (a canary
        rollout's follow label may name an older one). This vLLM takes full weights only:
        NotAnAdapter for `adapter_only`, nothing changed."""
        if adapter_only:
            raise NotAnAdapter(f"version {version}: this vLLM serves full weights only")
        await self.load(address, version)

    async def remove(self, version: int) -> None:
        """Full weights are only ever replaced; the rollout follower never removes them."""
        raise ValueError(f"version {version}: full weights cannot be unloaded, only replaced")

    async def check(self) -> int:
        """Ask vLLM which version its workers serve (the oldest, should they differ).

        A worker that has committed nothing serves the weights vLLM started with
        (`initial_version`). Raises a retryable error (harnessrl.retry) when vLLM cannot be
        reached or is not ready, VllmUnusable when it answers without the dev-mode
        endpoints or the worker extension.
        """
        import httpx

        from harnessrl.weights.vllm_worker import served_versions_http

        try:
            served = await served_versions_http(self.url, timeout_s=min(self._timeout_s, 30.0))
        except httpx.HTTPStatusError as err:
            if is_retryable(err):
                raise  # 502/503/504: starting, or behind a proxy that is
            raise VllmUnusable(
                f"{self.url}: collective_rpc harnessrl_version answered "
                f"{err.response.status_code} ({_excerpt(err.response)}); vLLM must run with "
                "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                "harnessrl.weights.vllm_worker.WeightSyncWorkerExtension"
            ) from err
        if not served:
            raise VllmUnusable(f"{self.url}: collective_rpc harnessrl_version answered no worker")
        self._version = min(self._initial if v is None else v for v in served)
        return self._version

    async def load(self, address: str, version: int) -> None:
        """Pause vLLM, stage `version` on every worker, commit, resume (see WeightLoader).

        Raises VersionGone when the trainer no longer holds the version, RetryableError (or
        a retryable httpx error) when the trainer or vLLM cannot be reached, NotStaged or
        httpx.HTTPStatusError when vLLM refused the version: the old weights keep serving
        (unless the commit itself failed, which leaves vLLM paused; see vllm_worker).
        """
        from harnessrl.weights.vllm_worker import NotStaged, update_weights_http

        try:
            await update_weights_http(
                self.url,
                address,
                version,
                pause_mode=self._pause_mode,
                timeout_s=self._timeout_s,
            )
        except NotStaged as err:
            if "unreachable" in err.reasons:
                raise RetryableError(f"trainer unreachable from vLLM's workers: {err}") from err
            if all(reason == "gone" for reason in err.reasons):
                raise VersionGone(str(err)) from err
            raise
        self._version = version


def _excerpt(response: Any) -> str:
    return " ".join(response.text.split())[:300] or "no body"
