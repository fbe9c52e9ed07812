// binding: filled in below
