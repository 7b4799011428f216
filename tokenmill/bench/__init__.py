"""Benchmark support: request datasets (ShareGPT, random tokens) shared by the benchmark scripts."""
