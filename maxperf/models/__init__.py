"""The transformer family, its presets and configs, logical-axis sharding rules, and the train step."""
