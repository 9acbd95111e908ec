"""How a command's process starts and ends, apart from what it computes: where glibc puts a CPU run's freed
tensors and whether fresh ones get huge pages (`host_memory`), and an exit without the interpreter's teardown
(`exit`). The console scripts opt in through `commands`, the targets of pyproject's [project.scripts]; importing
forge as a library changes neither."""
