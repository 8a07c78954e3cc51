"""ColossalAI's `nn` package path: only `nn.optimizer` (HybridAdam, FusedAdam, CPUAdam) is kept."""
