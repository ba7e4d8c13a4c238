"""Each recipe model's cluster (nodes, vLLM tensor parallelism), shared by its FSDP and Megatron recipes;
package data (a package so that setuptools ships it as one)."""
