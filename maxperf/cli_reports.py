"""`maxperf sweep` and `maxperf report`."""

COMMANDS: list = []
