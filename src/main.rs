fn main() {
    std::process::exit(gpuam::cli::main());
}
