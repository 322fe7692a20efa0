"""streamsched.stdlib"""
