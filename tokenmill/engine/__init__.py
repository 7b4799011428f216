"""The engine: request intake, the step loop (schedule → run → update → detokenize) and the offline LLM API."""
