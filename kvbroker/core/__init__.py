"""The pure core: the vocabulary, errors, validation, the topology rules, the planner and the part arithmetic.

No I/O, no gRPC, no backend library; core imports only core."""
