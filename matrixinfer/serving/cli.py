"""CLI subcommands of this subsystem (registered by matrixinfer.cli)."""


def register(sub, bench_sub) -> None:
    pass
