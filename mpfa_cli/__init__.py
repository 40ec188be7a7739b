"""The serving benchmark harness under the `mpfa` CLI: servers (SGLang, the simulator, a URL), the client, workloads,
metrics, the results store, tables, plots, the regression gate and the logits check. The CLI (`mpfa.cli`) and the
profiler (`mpfa.profiles`) build on it; it imports neither."""
