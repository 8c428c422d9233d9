"""One doctor run: the stack (started for it, or running), the episodes, the report files."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from harnessrl import registry
from harnessrl.apps.doctor.collect import DoctorError, collect
from harnessrl.apps.up.attach import stack_for_run
from harnessrl.tasks import TaskLine

__all__ = ["DoctorError", "DoctorOptions", "run_doctor"]

STACK_ENV = {"HARNESSRL_GATEWAY__CAPTURE_BODIES": "true"}
"""A stack the doctor starts records the harness's request and response bodies (the wire
checks read the sampling fields, budgets and tools the harness sent)."""


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    out: Path
    tasks: list[TaskLine]
    tasks_file: Path
    episodes: int
    mode: str
    group_size: int = 4
    config: Path | None = None
    """`harnessrl up` config of the stack to start; with stack_file, only read."""
    stack_file: Path | None = None
    timeout_s: float = 1800.0
    markups: tuple[str, ...] = ()
    """Tool-call markup beyond the known formats."""
    ready_timeout_s: float = 300.0


async def run_doctor(options: DoctorOptions, progress: IO[str]) -> dict[str, Any]:
    """Run the episodes, write out/doctor.json and out/doctor.html, return the report."""
    from harnessrl.apps.doctor.analyze import analyze
    from harnessrl.apps.doctor.report_html import write_html
    from harnessrl.apps.doctor.report_text import write_json

    stack_cm = stack_for_run(
        options.out,
        config=options.config,
        stack_file=options.stack_file,
        progress=progress,
        error=DoctorError,
        env=STACK_ENV,
        without=tuple(sorted(registry.optional())),
        ready_timeout_s=options.ready_timeout_s,
    )
    async with stack_cm as stack:
        config = options.config or stack.config
        settings, tokenizer = _settings(config, options.markups)
        decode = await asyncio.to_thread(_decoder, tokenizer)
        collected = await collect(
            stack,
            options.tasks,
            episodes=options.episodes,
            mode=options.mode,
            group_size=options.group_size,
            progress=progress,
            timeout_s=options.timeout_s,
            context_limit=settings.context_limit,
        )
    report = analyze(collected, settings.analysis, decode)
    report["run"].update(
        config=str(config or ""),
        tasks=str(options.tasks_file),
        stack="own" if options.stack_file is None else str(options.stack_file),
        tokenizer=str(tokenizer or ""),
    )
    await asyncio.to_thread(write_json, report, options.out / "doctor.json")
    await asyncio.to_thread(write_html, report, options.out / "doctor.html")
    return report


@dataclass(frozen=True, slots=True)
class _Loaded:
    analysis: Any
    context_limit: int | None


def _settings(config: Path | None, markups: tuple[str, ...]) -> tuple[_Loaded, Path | None]:
    """The analysis settings from the stack's config (the sample builder's, the gateway's
    train overrides and context length) and the tokenizer that decodes the ids."""
    from pydantic import ValidationError

    from harnessrl.apps.doctor.analyze import Settings
    from harnessrl.config import load_config
    from harnessrl.services.gateway.config import GatewayConfig
    from harnessrl.services.gateway.tool_markup import MARKUPS
    from harnessrl.services.inference.config import InferenceConfig
    from harnessrl.services.sample_builder.config import SampleBuilderConfig

    try:
        builder = load_config(SampleBuilderConfig, config).sample_builder
        gateway = load_config(GatewayConfig, config).gateway
        inference = load_config(InferenceConfig, config).inference
    except (ValidationError, FileNotFoundError) as err:
        raise DoctorError(f"{config}: {err}") from None
    tokenizer = builder.tokenizer or inference.model
    settings = Settings(builder=builder, train=gateway.train, markups=(*MARKUPS, *markups))
    return _Loaded(settings, gateway.max_model_len), tokenizer


def _decoder(path: Path | None) -> Any:
    """Token ids to text with the model's tokenizer; None (logged) when it cannot load."""
    from harnessrl.logs import get_logger
    from harnessrl.services.sample_builder.service import decoder

    if path is None:
        return None
    try:
        return decoder(str(path))
    except (OSError, ValueError) as err:
        get_logger(__name__).warning("doctor: no tokenizer", path=str(path), error=repr(err))
        return None
