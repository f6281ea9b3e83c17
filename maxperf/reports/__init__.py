"""HTML reports rendered from maxperf artifacts (compile, run and sweep directories).

    from maxperf.reports import render
    render(["artifacts/llama2-7b_v5p-1024", "sweeps/llama2-7b"], "report.html")
"""


def render(paths, out_html, command=None):
    from maxperf.reports.render import render as _render

    return _render(paths, out_html, command)
