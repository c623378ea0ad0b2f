"""What a rank sees and may reach: its workspace (a bubblewrap sandbox, or plain folders where bwrap cannot
run), the user it runs as, and the checkpoint folder of its own attempt."""
