"""The serving harness: scenarios, engines and servers (SGLang, the simulator, a URL), the load client and its
records."""
