"""The vocabulary every layer speaks: records, decisions, keys and durations."""
