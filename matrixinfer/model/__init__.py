"""matrixinfer.model"""
