"""HTML reports rendered from maxperf artifacts."""
