"""The strategies, peers behind one contract (`training.strategy.Strategy`): `baseline`,
`ps` (parameter server over gRPC) and `ddp` (ring all-reduce). None imports another."""
