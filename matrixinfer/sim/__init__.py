"""matrixinfer.sim"""
