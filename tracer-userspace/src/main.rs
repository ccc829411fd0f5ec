fn main() {
    println!("nattrace: under construction");
}
