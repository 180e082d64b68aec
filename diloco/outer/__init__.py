"""The outer algorithms: DiLoCo and Streaming DiLoCo rounds, the data-parallel baseline, the pure
outer update, fragments, reduction, quantization, overlap planning and the performance model.
"""
