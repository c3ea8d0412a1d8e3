"""matrixinfer.bench"""
