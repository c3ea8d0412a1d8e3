"""matrixinfer.serving"""
