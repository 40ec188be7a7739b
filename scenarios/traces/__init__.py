"""Request traces (JSONL, the Mooncake layout) that scenarios replay, and the script that writes the shipped one."""
