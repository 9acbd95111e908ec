"""forge-train's planning flags, without torch: the command looks for them before it composes a config, and only
then imports the planner (forge.planning.report), which takes them out of argv."""

PLAN_OPTIONS = ("--materialize", "--search", "--search-top")
"""Flags that go only with --plan."""


def has_plan_flags(argv: list[str]) -> bool:
    return any(flag in argv for flag in ("--plan", *PLAN_OPTIONS))
