"""The compile family: torch.compile/dynamo, Triton autotune, FA4 (CuTe DSL) compiles and recompiles."""
