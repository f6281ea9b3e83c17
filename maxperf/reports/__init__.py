"""HTML reports rendered from maxperf artifacts (compile, run and sweep directories).

    from maxperf.reports import render
    render(["artifacts/llama2-7b_v5p-1024", "sweeps/llama2-7b"], "report.html")
"""

# The function, bound after its module loads: a lazy wrapper here was replaced by the submodule `render` on first use.
from maxperf.reports.render import render

__all__ = ["render"]
