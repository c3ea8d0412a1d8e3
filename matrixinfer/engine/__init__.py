"""matrixinfer.engine"""
