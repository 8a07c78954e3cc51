import os

# Tests never touch the network: tiny models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one); "
                                       "benchmarks/gpu_check.sh runs them")
