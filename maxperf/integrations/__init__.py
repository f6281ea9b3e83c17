"""Other codebases' steps as maxperf user steps (`maxperf compile --step MODULE:FACTORY`)."""
