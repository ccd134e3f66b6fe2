"""What a call is: reading its arguments (pure checks), its fingerprint, and the messages when ranks disagree."""
