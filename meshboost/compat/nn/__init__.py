"""ColossalAI's `nn` package path: `nn.optimizer` (HybridAdam, FusedAdam, CPUAdam as torch's Adam) and
`nn.lr_scheduler` (ColossalAI's schedules on torch.optim.lr_scheduler). ColossalAI's layers are not kept."""
